"""Errors of the model store. Every message is one line that names the file or model concerned."""

from __future__ import annotations

from specserve.errors import UserError


class ModelStoreError(UserError):
    """Base class of every error raised by `specserve.models`."""


class ModelNotFoundError(ModelStoreError):
    """A model name is not in the catalog and is not an existing file."""


class PartDownloadError(ModelStoreError):
    """A part package could not be located, downloaded or read."""


class ModelCacheError(ModelStoreError):
    """The model cache directory cannot be written (read-only, full, or not a directory)."""


class ModelIntegrityError(ModelStoreError):
    """An assembled or stored file does not have the pinned size or sha256."""


class GGUFFileError(ModelStoreError):
    """A file is missing, is not GGUF, or is shorter than its tensor data needs."""


class IncompatibleVocabError(ModelStoreError):
    """A draft model's vocabulary cannot be used to speculate for a target model."""
