"""Hugging Face Hub ids as model names: ``org/name`` or ``org/name@revision``.

Resolved with ``huggingface_hub.snapshot_download`` into its standard cache (``HF_HOME`` /
``HF_HUB_CACHE``), so a model downloaded once on a node (by Duet, ``hf download`` or transformers)
is reused, and concurrent workers on one node share one download (huggingface_hub locks each
file). huggingface_hub itself honours ``HF_HUB_OFFLINE`` (cache only) and ``HF_TOKEN`` (gated and
private repos) and shows a tqdm progress bar per file on a terminal. Only what the engine loads
is fetched: config, generation config, tokenizer files and safetensors weights.

Errors name the id and what to do: not in the cache while offline, no such repo or revision,
gated without a token, or no safetensors weights in the repo.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from workers.errors import CheckpointError, ModelNotFoundError

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
ALLOW = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
         "special_tokens_map.json", "*.model", "vocab.*", "merges.txt", "added_tokens.json", "chat_template.*"]


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def split_revision(name: str) -> tuple[str, str | None]:
    repo, _, rev = name.partition("@")
    return repo, rev or None


def resolve_hub(name: str, cache_dir: Path | None = None) -> Path:
    """The local snapshot directory of Hub id ``name`` (downloading what is missing, unless offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo, revision = split_revision(name)
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW, cache_dir=cache_dir))
    except GatedRepoError:
        raise ModelNotFoundError(f"model {name!r} is gated on the Hugging Face Hub: accept its license there and "
                                 "set HF_TOKEN to a token with access") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {name!r}: revision {revision!r} does not exist on the Hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model {name!r} is not a Hugging Face Hub repository (or it is private: set "
                                 "HF_TOKEN), nor a local directory") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {name!r} is not in the local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE "
            "is set or there is no network): download it once with `hf download " + repo
            + (f" --revision {revision}" if revision else "") + "` where the Hub is reachable and share the cache "
            "(HF_HOME), or pass a local checkpoint directory (config.json + *.safetensors)") from None
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"model {name!r} ({path}) has no *.safetensors weights; Duet loads safetensors "
                              "checkpoints (convert .bin weights, or pass a .gguf file)")
    logger.info("model %s resolved to %s", name, path)
    return path
