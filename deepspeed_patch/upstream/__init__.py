"""The upstream pull request to DeepSpeed: the patch, how it is made (``build``) and applied (``apply``)."""
