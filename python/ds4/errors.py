"""The ds4 exception hierarchy.

Every failure a checkpoint can have is a subclass of :class:`CheckpointError`
with a stable ``code`` (a short snake_case string that never changes between
releases) and the ``stage`` of the verification pipeline that raised it
(``open``, ``header``, ``text``, ``payload``, ``engine``; ``block``: a KV block file).

The *class* of a failure decides what recovery does with the file:

* :class:`CorruptCheckpointError` -- the bytes are damaged: the session is
  invalidated and the file is removed (or quarantined).
* :class:`IncompatibleCheckpointError` -- the file is fine but belongs to
  another engine, model, layout or context size: it is skipped and kept.
* :class:`CheckpointMismatchError` -- the file is fine but is not a prefix of
  the prompt (or is not a checkpoint name at all): skipped and kept.

Exceptions raised by the Rust core are built here, through
:func:`from_core`, so ``ds4.errors`` is the one place that defines them.
Every class pickles (``__reduce__``) and is importable from this module.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ERROR_CODES",
    "AbiMismatchError",
    "BadFrameError",
    "BadMagicError",
    "BadMetadataError",
    "BadNameError",
    "BadPaddingError",
    "BadV1PayloadError",
    "BlockError",
    "ChatTemplateError",
    "ChatTemplateSegmentsError",
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConstraintError",
    "ContextOverflowError",
    "ContextTooSmallError",
    "CorruptCheckpointError",
    "Ds4Error",
    "EmptyPromptError",
    "EngineError",
    "EngineStateError",
    "FrameTableError",
    "HeaderChecksumError",
    "HeaderTooLargeError",
    "ImportFailedError",
    "IncompatibleCheckpointError",
    "InvalidSessionError",
    "MacMismatchError",
    "MacMissingError",
    "NameMismatchError",
    "NoChatTemplateError",
    "NotPrefixError",
    "NotRegularFileError",
    "PayloadChecksumError",
    "PrefillCancelledError",
    "PrefixCollisionError",
    "PromptError",
    "QuantMismatchError",
    "RemoteChunkError",
    "RemoteManifestError",
    "RemoteTierError",
    "ReservedBytesError",
    "SessionError",
    "SizeOverflowError",
    "StoreError",
    "StoreFullError",
    "TensorTableError",
    "TextHashMismatchError",
    "TokenCountMismatchError",
    "TokensTextMismatchError",
    "TooShortError",
    "TrailingBytesError",
    "TruncatedCheckpointError",
    "UnsupportedCodecError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "V1IgnoredError",
    "from_core",
]


class Ds4Error(Exception):
    """Root of every error ds4 raises on purpose."""


class CheckpointError(Ds4Error, ValueError):
    """A checkpoint file failed verification.

    ``code`` is stable across releases, ``stage`` names the pipeline stage,
    ``path`` is the file (when known) and ``reason`` the human message.
    """

    code: str = "checkpoint_error"
    stage: str = "open"
    kind: str = "corrupt"

    def __init__(self, reason: str = "", *, path: str | None = None, stage: str | None = None, code: str = ""):
        self.code = code or self.code  # per instance: BlockError has many codes, a stage may depend on one
        self.stage = stage or getattr(self, "stages", {}).get(self.code, self.stage)
        self.reason = reason or (self.__class__.__doc__ or self.code).strip().splitlines()[0]
        self.path, where = path, f" [{path}]" if path else ""
        super().__init__(f"{self.code} (stage {self.stage}): {self.reason}{where}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.__class__, self.reason, self.path, self.stage, self.code), self.__dict__)


def _rebuild(cls: type[CheckpointError], reason: str, path: str | None, stage: str, code: str = "") -> CheckpointError:
    return cls(reason, path=path, stage=stage, code=code)


class CorruptCheckpointError(CheckpointError):
    """The checkpoint's bytes are damaged; it must be removed."""

    kind = "corrupt"


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is intact but was written for another engine or layout."""

    kind = "incompatible"


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but does not apply to this prompt."""

    kind = "mismatch"


# -- authentication (FORMAT.md §1.9) ------------------------------------------


class MacMissingError(IncompatibleCheckpointError):
    """An authentication key is configured and the checkpoint carries no MAC."""

    code, stage = "mac_missing", "header"


class MacMismatchError(CorruptCheckpointError):
    """The checkpoint's MAC does not match (forged, damaged, or written with another key)."""

    code, stage = "mac_mismatch", "payload"


# -- the shared tier (ds4/kvstore/remote.py) -------------------------------


class RemoteManifestError(CorruptCheckpointError):
    """A remote checkpoint's manifest is not one ds4 wrote (damaged or forged)."""

    code, stage = "remote_manifest", "header"


class RemoteChunkError(CorruptCheckpointError):
    """A remote checkpoint's payload chunk is missing, truncated or does not match its manifest."""

    code, stage = "remote_chunk", "payload"


class BlockError(CorruptCheckpointError):
    """A KV block file (FORMAT.md §7) is missing, damaged, forged, or not the block its name says."""

    code, stage, block, stages = "block_corrupt", "block", "", {"block_table": "payload"}  # block: the hex name
    codes = "block_table block_missing block_corrupt block_short block_name block_abi block_checksum block_mac_missing block_mac"


# -- open ------------------------------------------------------------------
class NotRegularFileError(CorruptCheckpointError):
    """The path is not a regular file (a directory, a symlink, a device)."""

    code, stage = "not_regular_file", "open"


class BadNameError(CheckpointMismatchError):
    """The file name is not `<40 hex sha1>.kv`."""

    code, stage = "bad_name", "open"


# -- header (corrupt) ------------------------------------------------------
class TooShortError(CorruptCheckpointError):
    """The file is shorter than the fixed header."""

    code, stage = "too_short", "header"


class BadMagicError(CorruptCheckpointError):
    """The file does not start with the KVC magic."""

    code, stage = "bad_magic", "header"


class ReservedBytesError(CorruptCheckpointError):
    """A reserved header byte is not zero."""

    code, stage = "reserved_nonzero", "header"


class HeaderChecksumError(CorruptCheckpointError):
    """The header checksum does not match the header bytes."""

    code, stage = "header_checksum", "header"


class SizeOverflowError(CorruptCheckpointError):
    """Declared sizes overflow when added up."""

    code, stage = "size_overflow", "header"


class HeaderTooLargeError(CorruptCheckpointError):
    """A declared header section is larger than the format allows."""

    code, stage = "header_too_large", "header"


class BadMetadataError(CorruptCheckpointError):
    """The ABI string or tensor table cannot be decoded."""

    code, stage = "bad_metadata", "header"


class TruncatedCheckpointError(CorruptCheckpointError):
    """The file is shorter than its header says."""

    code, stage = "truncated", "header"


class TrailingBytesError(CorruptCheckpointError):
    """The file is longer than its header says."""

    code, stage = "trailing_bytes", "header"


class BadPaddingError(CorruptCheckpointError):
    """Alignment padding between text and payload is not zero."""

    code, stage = "bad_padding", "header"


# -- header (incompatible) -------------------------------------------------
class UnsupportedVersionError(IncompatibleCheckpointError):
    """The format version is not one this build reads (kept: a newer ds4 may own it)."""

    code, stage = "unsupported_version", "header"


class UnsupportedCodecError(IncompatibleCheckpointError):
    """A v3 file's payload codec or filter is not one this build reads
    (kept: a newer ds4 may own it)."""

    code, stage = "unsupported_codec", "header"


class AbiMismatchError(IncompatibleCheckpointError):
    """The payload ABI (engine, model, layout) differs from the session's."""

    code, stage = "abi_mismatch", "header"


class QuantMismatchError(IncompatibleCheckpointError):
    """The quantization differs and the store rejects other quantizations."""

    code, stage = "quant_mismatch", "header"


class ContextTooSmallError(IncompatibleCheckpointError):
    """The checkpoint holds more tokens than the session's context can take."""

    code, stage = "ctx_too_small", "header"


# -- text ------------------------------------------------------------------
class V1IgnoredError(IncompatibleCheckpointError):
    """A ds4 v1 header ds4's own reader ignores (quantization not 2 or 4
    bits, no tokens): skipped and kept, as ds4 keeps it."""

    code, stage = "v1_ignored", "header"


class TextHashMismatchError(CorruptCheckpointError):
    """SHA-1 of the stored text differs from the SHA-1 recorded in the header."""

    code, stage = "text_sha1_mismatch", "text"


class NameMismatchError(CorruptCheckpointError):
    """SHA-1 of the stored text differs from the file name."""

    code, stage = "name_mismatch", "text"


class NotPrefixError(CheckpointMismatchError):
    """The stored text is not a byte prefix of the prompt."""

    code, stage = "not_prefix", "text"


class CheckpointChangedError(CheckpointMismatchError):
    """Another process opened the file for writing while its map was being
    read (its lease was broken long enough for the writer to get through):
    what was read may not be what was verified. The session that read it is
    invalidated; the file is skipped and kept (it may be fine now)."""

    code, stage = "changed_while_loading", "payload"


class PrefixCollisionError(CorruptCheckpointError):
    """The prompt prefix hashes to the file name but its bytes differ."""

    code, stage = "prefix_collision", "text"


# -- payload ---------------------------------------------------------------
class TensorTableError(CorruptCheckpointError):
    """A tensor is out of bounds, misaligned or of the wrong size."""

    code, stage = "tensor_table", "payload"


class PayloadChecksumError(CorruptCheckpointError):
    """The payload checksum does not match the payload bytes."""

    code, stage = "payload_checksum", "payload"


class FrameTableError(CorruptCheckpointError):
    """A v3 frame table disagrees with the frame span or the stored payload."""

    code, stage = "frame_table", "header"


class BadFrameError(CorruptCheckpointError):
    """A v3 payload frame does not decompress, decompresses to another
    length than its table entry says, or its raw bytes do not match the
    entry's hash: the load stops at that frame."""

    code, stage = "bad_frame", "payload"


class BadV1PayloadError(CorruptCheckpointError):
    """A ds4 v1 DSV4 payload header cannot be decoded."""

    code, stage = "bad_v1_payload", "payload"


# -- engine ----------------------------------------------------------------
class TokenCountMismatchError(CorruptCheckpointError):
    """The payload's token count differs from the header's."""

    code, stage = "token_count_mismatch", "engine"


class TokensTextMismatchError(CorruptCheckpointError):
    """The payload's tokens do not render the checkpoint's verified text."""

    code, stage = "tokens_text_mismatch", "engine"


class EngineStateError(CorruptCheckpointError):
    """The engine rejected the payload (shapes, dtypes, missing tensors)."""

    code, stage = "engine_rejected", "engine"


class ImportFailedError(IncompatibleCheckpointError):
    """Importing the payload failed with an error that does not prove the
    file corrupt (a limit of numpy or of the engine): skipped and kept."""

    code, stage = "import_failed", "engine"


# -- sessions, engines, stores ---------------------------------------------
class SessionError(Ds4Error):
    """A session operation failed."""


class InvalidSessionError(SessionError, RuntimeError):
    """The session has no valid checkpoint: it cannot be extended or saved."""


class PrefillCancelledError(SessionError):
    """A prefill stopped at a chunk boundary because its caller asked (a
    client that went away). The session is valid at the tokens evaluated so
    far, a prefix of the ones asked for; nothing was lost."""

    def __init__(self, n_past: int, n_tokens: int):
        self.n_past, self.n_tokens = n_past, n_tokens
        super().__init__(f"prefill cancelled at {n_past} of {n_tokens} tokens")

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.n_past, self.n_tokens))


class PromptError(SessionError, ValueError):
    """The prompt (or a stop sequence) cannot be used: raised before the
    session is touched, so the live state stays as it was."""


class ContextOverflowError(PromptError):
    """The prompt does not fit the session's context."""

    def __init__(self, n_tokens: int, ctx: int):
        self.n_tokens, self.ctx = n_tokens, ctx
        super().__init__(f"prompt of {n_tokens} tokens does not fit context {ctx}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.n_tokens, self.ctx))


class EmptyPromptError(PromptError):
    """The prompt is empty."""


class ConstraintError(PromptError):
    """A constraint on the output (a JSON schema, a grammar) cannot be used:
    invalid, unsupported or over the grammar library's limits. Raised before
    the session is touched (a server answers 400)."""

    code = "invalid_constraint"


class ChatTemplateError(PromptError):
    """The chat cannot be rendered with the model's chat template: the
    template refused the conversation (its ``raise_exception``: roles that
    do not alternate, say), failed, or was handed a message that is not a
    role and a content string. Raised before the session is touched (a
    server answers 400)."""


class ChatTemplateSegmentsError(ChatTemplateError):
    """The template's output cannot be split faithfully into its own text
    (where markers may be) and the messages' contents (client text, never a
    marker): it cuts into or transforms a content beyond stripping its
    whitespace (:mod:`ds4.engines.chat_template`). ds4 refuses rather than
    guess which text is whose."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template in its GGUF and ds4 has no built-in
    format for its architecture: run the prompt as raw text (``--raw``)."""


class EngineError(Ds4Error, RuntimeError):
    """The engine failed while prefilling or decoding."""


class UnsupportedModelError(EngineError):
    """llama.cpp loads the model but ds4 cannot run it: its architecture
    (``arch``) cannot decode a prompt here, or its memory offers nothing ds4
    can keep exact. ``code`` is stable; the message says what to do."""

    code = "model_unsupported"

    def __init__(self, arch: str, reason: str, hint: str):
        self.arch, self.reason, self.hint = arch, reason, hint
        super().__init__(f"{self.code}: architecture {arch!r}: {reason}; {hint}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.arch, self.reason, self.hint))


class StoreError(Ds4Error, OSError):
    """The checkpoint store could not complete an operation."""


class StoreFullError(StoreError):
    """The checkpoint does not fit the store's budget."""


class RemoteTierError(StoreError):
    """The shared tier (Redis) cannot be reached or refused an operation;
    the store goes on with its local directory."""


def _all_checkpoint_classes() -> dict[str, type[CheckpointError]]:
    out: dict[str, type[CheckpointError]] = {}
    stack: list[type[CheckpointError]] = [CheckpointError]
    while stack:
        c = stack.pop()
        stack.extend(c.__subclasses__())
        if "code" in c.__dict__ and c is not CheckpointError:  # concrete classes only
            out.update(dict.fromkeys(c.__dict__.get("codes", c.code).split(), c))
    return out


#: stable code -> exception class, for every checkpoint failure kind
ERROR_CODES = _all_checkpoint_classes()


def from_core(code: str, message: str, path: str | None = None, stage: str | None = None) -> CheckpointError:
    """Build the exception for an error ``code`` reported by the Rust core (at its ``stage``)."""
    return ERROR_CODES.get(code, CorruptCheckpointError)(message, path=path, stage=stage, code=code)
