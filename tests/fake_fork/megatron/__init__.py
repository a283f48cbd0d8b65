"""The fake fork's package (see ../README.md)."""
