"""`python -m jaxserve.convert --model SRC --output DIR`: write an Orbax checkpoint.

SRC is anything the server loads (an HF directory, a .gguf file, or nothing for
the default model). GGUF tensors are dequantized once here, so later start-ups
restore ready arrays, each straight into its sharding.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="source (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="write no tokenizer (a checkpoint without one)")
    args = parser.parse_args(argv)

    from jaxserve.models.loaders import load_checkpoint
    from jaxserve.models.loaders.orbax_loader import save_orbax
    from jaxserve.models.model_files import resolve_model
    from jaxserve.models.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    files = resolve_model(args.model)
    import ml_dtypes

    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[args.dtype]
    arch, params = load_checkpoint(files, np.dtype(dtype))
    save_orbax(args.output, arch, params)
    if not args.skip_tokenizer_init:
        load_tokenizer(files).save_pretrained(args.output)
    print(f"wrote {args.output} ({arch.architecture}, {arch.num_hidden_layers} layers) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
