"""Megatron's indexed dataset: token sequences in `PREFIX.bin`, their index in `PREFIX.idx`.

Reads and writes the MMIDIDX v1 format (`--data-impl mmap`) byte for byte as Megatron does, and the
legacy TNTIDX format (`--data-impl lazy` / `cached`).
"""

from __future__ import annotations

import array
import hashlib
import os
import struct
from collections.abc import Sequence
from typing import overload

import numpy as np

from rapidtrain.core.errors import UserError

MMAP_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
# magic, version, dtype code, sequence count S, document-index length D
_MMAP_HEADER = struct.Struct("<9sQBQQ")
# magic, version, dtype code, element size, item count n, size-entry count s, document count
_LEGACY_HEADER = struct.Struct("<8sQQQQQQ")
_PREFIX_HINT = "--data-path is a prefix without extension (PREFIX names PREFIX.bin and PREFIX.idx)"


class DataFileError(UserError, ValueError):
    """An indexed-dataset file is missing, corrupt, or not in a format rapidtrain reads."""


class MissingDataFileError(DataFileError, FileNotFoundError):
    """`PREFIX.bin` or `PREFIX.idx` does not exist."""


def best_dtype(vocab_size: int | None) -> type[np.integer]:
    """The token dtype Megatron picks: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype: np.dtype | type) -> int:
    """The one-byte code of `dtype` in the index header."""
    wanted = np.dtype(dtype)
    for code, known in DTYPE_CODES.items():
        if known == wanted:
            return code
    raise ValueError(f"dtype {wanted} cannot be stored in an indexed dataset; use one of {_dtype_names()}")


def _dtype_names() -> str:
    return ", ".join(str(d) for d in DTYPE_CODES.values())


class IndexedDatasetBuilder:
    """Writes `.bin` as sequences arrive and the MMIDIDX `.idx` in `finalize`."""

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.uint16) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype)
        self._bin = open(bin_path, "wb")
        self._sequence_lengths = array.array("q")
        self._document_indices = array.array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document."""
        self._write_tokens(tokens)
        self._sequence_lengths.append(len(tokens))

    def end_document(self) -> None:
        """Close the current document; an empty document still adds a boundary."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append a whole document made of `sequences` (one sequence without sentence splitting)."""
        for tokens in sequences:
            self.add_item(tokens)
        self.end_document()

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: Sequence[int], sequences_per_document: Sequence[int]
    ) -> None:
        """Append many documents at once: `tokens` is their sequences concatenated."""
        if int(np.sum(sequence_lengths, dtype=np.int64)) != len(tokens):
            raise ValueError("add_documents: sequence_lengths must sum to the number of tokens")
        if int(np.sum(sequences_per_document, dtype=np.int64)) != len(sequence_lengths):
            raise ValueError("add_documents: sequences_per_document must sum to len(sequence_lengths)")
        self._write_tokens(tokens)
        first = len(self._sequence_lengths)
        self._sequence_lengths.extend(int(n) for n in sequence_lengths)
        self._document_indices.extend(int(n) for n in first + np.cumsum(sequences_per_document))

    def _write_tokens(self, tokens: Sequence[int] | np.ndarray) -> None:
        values = np.asarray(tokens)
        if values.size and self.dtype.kind in "iu" and values.dtype != self.dtype:
            limits = np.iinfo(self.dtype)
            low, high = values.min(), values.max()
            if low < limits.min or high > limits.max:
                raise ValueError(
                    f"{self.bin_path}: token id {low if low < limits.min else high} does not fit in "
                    f"{self.dtype}; build with dtype=best_dtype(vocab_size) or np.int32"
                )
        self._bin.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())

    def close(self) -> None:
        """Close the `.bin` file without writing an index (for abandoning a build)."""
        self._bin.close()

    def finalize(self, idx_path: str) -> None:
        """Flush `.bin` and write the index; a document left open is closed first."""
        if self._document_indices[-1] != len(self._sequence_lengths):
            self.end_document()
        self._bin.close()
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.bin_path}: a sequence longer than 2**31-1 tokens cannot be indexed")
        with open(idx_path, "wb") as index:
            self._write_index(index, lengths)

    def _write_index(self, index, lengths: np.ndarray) -> None:
        index.write(
            _MMAP_HEADER.pack(MMAP_MAGIC, INDEX_VERSION, self.code, len(lengths), len(self._document_indices))
        )
        index.write(lengths.astype("<i4").tobytes())
        offsets = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=offsets[1:])
        index.write(offsets.tobytes())
        index.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8").tobytes())


class LegacyIndexedDatasetBuilder(IndexedDatasetBuilder):
    """Writes the older TNTIDX index that `--data-impl lazy` and `cached` read (1-D sequences)."""

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.int32) -> None:
        super().__init__(bin_path, dtype)

    def _write_index(self, index, lengths: np.ndarray) -> None:
        count = len(lengths)
        index.write(
            _LEGACY_HEADER.pack(
                LEGACY_MAGIC,
                INDEX_VERSION,
                self.code,
                self.dtype.itemsize,
                count,
                count,
                len(self._document_indices),
            )
        )
        # Each sequence is 1-D: one size entry each, and data offsets counted in elements.
        dim_offsets = np.arange(count + 1, dtype="<i8")
        data_offsets = np.zeros(count + 1, dtype="<i8")
        np.cumsum(lengths, out=data_offsets[1:])
        for values in (dim_offsets, data_offsets, lengths.astype("<i8")):
            index.write(values.tobytes())
        index.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8").tobytes())


class IndexedDataset:
    """The sequences of `PREFIX.bin`/`PREFIX.idx`; `ds[i]` is a read-only, zero-copy numpy view.

    `impl`: "mmap" memory-maps MMIDIDX files; "cached" loads a legacy TNTIDX `.bin` into memory;
    "lazy" reads legacy sequences from the file on demand; "infer" picks by the index's magic. It is the
    --data-impl value as given: another name is refused here, naming the flag.
    """

    _fd: int | None = None  # the lazy reader's descriptor, opened on first read

    def __init__(self, prefix: str, impl: str = "mmap") -> None:
        self.prefix = prefix
        self.requested_impl = impl
        idx_path, bin_path = _existing_files(prefix)
        self._bin_path, self._idx_path = bin_path, idx_path
        self._fingerprint: str | None = None
        self._bin: np.ndarray | None = None
        try:
            self._open(impl)
        except OSError as error:  # unreadable (permissions, an I/O error): the file and the reason
            raise DataFileError(f"{error.filename or prefix}: cannot read it ({error.strerror or error}); "
                                "check its permissions, or rebuild it with scripts/preprocess_data.py") from None

    def _open(self, impl: str) -> None:
        idx_path, bin_path = self._idx_path, self._bin_path
        self.impl = _resolve_impl(impl, idx_path)
        read_index = _read_mmap_index if self.impl == "mmap" else _read_legacy_index
        self.dtype, self.sequence_lengths, self._offsets, self.document_indices = read_index(idx_path)
        self._itemsize = self.dtype.itemsize
        bin_size = _check_bin_size(bin_path, self.sequence_lengths, self._offsets, self._itemsize)
        # After the size check, whose message names a wrong dtype code; this one finds damage inside the index.
        _check_sequence_layout(idx_path, self.sequence_lengths, self._offsets, self._itemsize)
        self._opened_as = _file_states(idx_path, bin_path)  # what a change under the run is measured against
        if self.impl == "mmap" and bin_size:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")
        elif self.impl == "cached" or bin_size == 0:
            self._bin = np.fromfile(bin_path, dtype=np.uint8)
            self._bin.flags.writeable = False

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(i)

    @property
    def fingerprint(self) -> str:
        """The files' content as index caches key it: sizes, modification times and a hash of the .idx (a corpus
        preprocessed again into the same prefix, with the same counts, gets another key)."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=16)
            with open(self._idx_path, "rb") as index:
                for block in iter(lambda: index.read(2**22), b""):
                    digest.update(block)
            states = " ".join(f"{size}@{mtime}" for size, mtime in self._opened_as)
            self._fingerprint = f"{states} idx:{digest.hexdigest()}"
        return self._fingerprint

    def check_unchanged(self) -> None:
        """DataFileError when the .bin or .idx is no longer the file opened (rewritten, truncated, replaced): reading
        on would return other tokens, fail on an offset, or end in a bus error on a shrunk memory map."""
        try:
            now = _file_states(self._idx_path, self._bin_path)
        except OSError:
            now = None
        if now != self._opened_as:
            changed = [path for path, before, after in zip((self._idx_path, self._bin_path), self._opened_as,
                                                           now or (None, None), strict=True) if before != after]
            raise DataFileError(f"data file {', '.join(changed)} changed while training (size or modification time "
                                "differs from when it was opened): restore it, or restart the run on the new data "
                                "(its index cache is rebuilt).")

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `i` (to its end when length is None)."""
        self.check_unchanged()  # two stat calls: cheap beside the copy, and a shrunk map would SIGBUS
        count = len(self)
        if not -count <= i < count:
            raise IndexError(f"{self.prefix}: sequence {i} out of range (0..{count - 1})")
        i = int(i) % count
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {i} of {size}"
            )
        start = int(self._offsets[i]) + offset * self._itemsize
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)
        return np.frombuffer(self._pread(start, length * self._itemsize), dtype=self.dtype)

    def _pread(self, start: int, nbytes: int) -> bytes:
        # pread keeps no file position, so a descriptor inherited by forked DataLoader workers is safe.
        if self._fd is None:
            self._fd = os.open(self._bin_path, os.O_RDONLY)
        data = os.pread(self._fd, nbytes, start)
        if len(data) != nbytes:
            raise DataFileError(f"{self._bin_path}: file shrank while reading; rebuild it")
        return data

    def close(self) -> None:
        """Release the lazy reader's file descriptor (the memory map goes with the object)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Maps and descriptors do not pickle; DataLoader workers started by spawn reopen the files.
        return {"prefix": self.prefix, "impl": self.requested_impl}

    def __setstate__(self, state: dict) -> None:
        IndexedDataset.__init__(self, state["prefix"], state["impl"])


def _file_states(*paths: str) -> tuple[tuple[int, int], ...]:
    states = []
    for path in paths:
        stat = os.stat(path)
        states.append((stat.st_size, stat.st_mtime_ns))
    return tuple(states)


def _looks_like_json(path: str) -> bool:
    """A file of JSON (an array or JSON lines) rather than a prefix: by its name or its first character."""
    if path.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
        return True
    try:
        with open(path, "rb") as file:
            head = file.read(256).lstrip()
    except OSError:
        return False
    return head[:1] in (b"{", b"[")


def _existing_files(prefix: str) -> tuple[str, str]:
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [path for path in (idx_path, bin_path) if not os.path.isfile(path)]
    if missing and os.path.isfile(prefix) and _looks_like_json(prefix):
        raise MissingDataFileError(
            f"--data-path {prefix}: a JSON file, not Megatron indexed data (no {' or '.join(missing)}). Make "
            f"indexed data from it with scripts/preprocess_data.py --input {prefix} --output-prefix PREFIX "
            "(tokenizer flags as for training) and pass --data-path PREFIX_text_document; or, for JSON "
            f"instruction/output records, pass --dataset LLama-Pretrain-Raw --train-data-path {prefix}")
    if missing:
        hint = _PREFIX_HINT
        if prefix.endswith((".bin", ".idx")):
            hint += f"; drop the extension: {prefix[:-4]}"
        raise MissingDataFileError(f"{' and '.join(missing)} not found; {hint}")
    return idx_path, bin_path


def _resolve_impl(impl: str, idx_path: str) -> str:
    with open(idx_path, "rb") as index:
        head = index.read(len(MMAP_MAGIC))
    if head == MMAP_MAGIC:
        found = "mmap"
    elif head[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        found = "legacy"
    else:
        raise DataFileError(
            f"{idx_path}: bad magic {head!r}: not a Megatron index (expected {MMAP_MAGIC!r} or {LEGACY_MAGIC!r})"
        )
    if impl == "infer":
        return "mmap" if found == "mmap" else "cached"  # Megatron infers "cached" for TNTIDX
    if impl not in ("mmap", "lazy", "cached"):
        raise ValueError(f"--data-impl {impl!r}: choose mmap, lazy, cached or infer")
    if (impl == "mmap") != (found == "mmap"):
        fix = "--data-impl lazy, cached or infer" if found == "legacy" else "--data-impl mmap or infer"
        raise DataFileError(f"{idx_path}: bad magic {head!r} for --data-impl {impl}: this file needs {fix}")
    return impl


def _read_header(idx_path: str, header: struct.Struct) -> tuple[int, tuple]:
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as index:
        raw = index.read(header.size)
    if len(raw) < header.size:
        raise DataFileError(
            f"{idx_path}: truncated: {size} bytes, shorter than its {header.size}-byte header; "
            "rebuild it with scripts/preprocess_data.py"
        )
    return size, header.unpack(raw)


def _dtype_of(idx_path: str, version: int, code: int) -> np.dtype:
    if version != INDEX_VERSION:
        raise DataFileError(f"{idx_path}: bad version {version}: only version {INDEX_VERSION} is known")
    if code not in DTYPE_CODES:
        raise DataFileError(f"{idx_path}: unknown dtype code {code}: expected 1..8 ({_dtype_names()})")
    return DTYPE_CODES[code]


def _check_index_size(idx_path: str, size: int, needed: int, what: str) -> None:
    if size < needed:
        raise DataFileError(
            f"{idx_path}: truncated: header says {what}, which needs {needed} bytes, but the file has "
            f"{size}; rebuild it with scripts/preprocess_data.py"
        )


def _check_document_indices(idx_path: str, documents: np.ndarray, sequences: int) -> None:
    if len(documents) == 0 or documents[0] != 0 or documents[-1] > sequences or np.any(np.diff(documents) < 0):
        raise DataFileError(
            f"{idx_path}: corrupt document index: it must start at 0, never decrease and end at most at "
            f"{sequences}; rebuild it with scripts/preprocess_data.py"
        )


def _check_sequence_layout(idx_path: str, lengths: np.ndarray, offsets: np.ndarray, itemsize: int) -> None:
    """Megatron's writer puts each sequence right after the one before it: a negative length, or an offset that
    leaves a gap or an overlap, is damage (read on, it would return other tokens or fail mid-run). Checked in
    chunks, so a corpus of many sequences needs no second copy of its index in memory."""
    chunk, end = 2**22, 0
    for first in range(0, len(lengths), chunk):
        sizes = np.asarray(lengths[first : first + chunk], dtype=np.int64)
        expected = np.empty(len(sizes), dtype=np.int64)
        expected[0] = end
        np.cumsum(sizes[:-1] * itemsize, out=expected[1:])
        expected[1:] += end
        if sizes.min() < 0 or not np.array_equal(np.asarray(offsets[first : first + chunk]), expected):
            raise DataFileError(
                f"{idx_path}: corrupt sequence index (negative lengths, or offsets that do not follow the lengths "
                f"at the header's {itemsize}-byte dtype): rebuild it with scripts/preprocess_data.py"
            )
        end = int(expected[-1]) + int(sizes[-1]) * itemsize


def _read_mmap_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    size, (_, version, code, sequences, doc_entries) = _read_header(idx_path, _MMAP_HEADER)
    dtype = _dtype_of(idx_path, version, code)
    start = _MMAP_HEADER.size
    needed = start + 12 * sequences + 8 * doc_entries
    _check_index_size(
        idx_path, size, needed, f"{sequences} sequences and {doc_entries} document-index entries"
    )
    buffer = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buffer, dtype="<i4", count=sequences, offset=start)
    offsets = np.frombuffer(buffer, dtype="<i8", count=sequences, offset=start + 4 * sequences)
    documents = np.frombuffer(buffer, dtype="<i8", count=doc_entries, offset=start + 12 * sequences)
    _check_document_indices(idx_path, documents, sequences)
    return dtype, lengths, offsets, documents


def _read_legacy_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    size, header = _read_header(idx_path, _LEGACY_HEADER)
    _, version, code, element_size, items, size_entries, doc_entries = header
    dtype = _dtype_of(idx_path, version, code)
    if element_size != dtype.itemsize:
        raise DataFileError(f"{idx_path}: element size {element_size} does not match dtype {dtype}")
    longs = 2 * (items + 1) + size_entries + doc_entries
    needed = _LEGACY_HEADER.size + 8 * longs
    _check_index_size(idx_path, size, needed, f"{items} items and {doc_entries} document-index entries")
    values = np.fromfile(idx_path, dtype="<i8", count=longs, offset=_LEGACY_HEADER.size)
    data_offsets = values[items + 1 : 2 * (items + 1)]
    documents = values[2 * (items + 1) + size_entries :]
    _check_document_indices(idx_path, documents, items)
    # Data offsets count elements; a sequence spans the elements up to the next one's offset.
    lengths = np.diff(data_offsets)
    if len(lengths) and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise DataFileError(f"{idx_path}: corrupt data offsets (they must grow, by less than 2**31 tokens a "
                            "sequence); rebuild it with scripts/preprocess_data.py")
    offsets = data_offsets[:-1] * element_size
    return dtype, lengths.astype(np.int32), offsets, documents


def _check_bin_size(bin_path: str, lengths: np.ndarray, offsets: np.ndarray, itemsize: int) -> int:
    """The .bin must hold exactly the tokens the index describes, at the header's dtype: Megatron's writer
    leaves no gap and no tail, so any other size means a wrong dtype code or files that do not belong together
    (a wrong dtype would otherwise be read as other, wrong tokens)."""
    size = os.path.getsize(bin_path)
    tokens = int(np.sum(lengths, dtype=np.int64))
    needed = tokens * itemsize
    last_end = int(offsets[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    consistent = size == needed == last_end and (not len(offsets) or int(offsets[0]) == 0)
    if consistent:
        return size
    fits = [str(d) for d in DTYPE_CODES.values() if tokens and d.kind in "iu" and d.itemsize != itemsize
            and size == tokens * d.itemsize]
    if not fits and size < last_end:
        raise DataFileError(
            f"{bin_path}: truncated: the index needs {last_end} bytes of tokens but the file has {size}; "
            "the .bin and .idx do not belong together or the copy was cut short"
        )
    dtype = next((str(d) for d in DTYPE_CODES.values() if d.itemsize == itemsize), f"{itemsize}-byte")
    raise DataFileError(
        f"{bin_path}: {size} bytes, but its index describes {tokens} tokens of {dtype} = {needed} bytes"
        + (f" (the size fits {' or '.join(fits)}: the dtype code in the .idx header is wrong)" if fits else "")
        + "; the .bin and .idx do not belong together or were damaged. Rebuild them with "
        "scripts/preprocess_data.py"
    )


def check_token_ids(dataset: IndexedDataset, vocab_size: int, sequences: int = 64, tokens_each: int = 4096) -> None:
    """Sampled check that token ids lie in [0, vocab_size): up to `sequences` sequences spread over the file
    (first and last included), `tokens_each` tokens of each. Catches data made with another tokenizer or a
    larger vocabulary, and a misread dtype, before the embedding meets an id it has no row for."""
    count = len(dataset)
    if count == 0:
        return
    for i in sorted({int(i) for i in np.linspace(0, count - 1, num=min(sequences, count))}):
        length = min(int(dataset.sequence_lengths[i]), tokens_each)
        if length == 0:
            continue
        ids = dataset.get(i, 0, length)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise DataFileError(
                f"{dataset.prefix}: token id {bad} in sequence {i} is outside the vocabulary [0, {vocab_size}) of "
                "the tokenizer flags: the data was preprocessed with another tokenizer (or --vocab-size), or its "
                ".idx names the wrong dtype. Use the tokenizer flags the data was made with, or rebuild it with "
                "scripts/preprocess_data.py and these flags."
            )


def warm_up(prefix: str, chunk: int = 64 * 2**20) -> int:
    """Megatron's --mmap-warmup: read PREFIX.bin (and .idx) once, so their pages are in the page cache before
    training reads them at random; the bytes read."""
    total = 0
    for path in _existing_files(prefix):
        with open(path, "rb", buffering=0) as stream:
            while block := stream.read(chunk):
                total += len(block)
    return total
