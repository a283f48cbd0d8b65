"""The fork's data tool's command line: JSONL of space-separated token ids -> PREFIX_text_document.{bin,idx}."""

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--input", "--output-prefix", "--tokenizer-type"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--append-eod", action="store_true")
    args = parser.parse_args()
    assert args.tokenizer_type == "NullTokenizer"
    documents = []
    with open(args.input) as jsonl:
        for line in jsonl:
            tokens = [int(token) for token in json.loads(line)["text"].split(" ")]
            documents.append(tokens + ([args.vocab_size] if args.append_eod else []))  # NullTokenizer's eod
    prefix = f"{args.output_prefix}_text_document"
    np.concatenate([np.asarray(doc, dtype=np.int32) for doc in documents]).tofile(prefix + ".bin")
    with open(prefix + ".idx", "w") as index:
        json.dump([len(doc) for doc in documents], index)


if __name__ == "__main__":
    main()
