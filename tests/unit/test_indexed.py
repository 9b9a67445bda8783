"""Megatron indexed dataset: bytes written exactly as the MMIDIDX / TNTIDX specs say, read back, and refused
with a message naming the file when missing or corrupt."""

import os
import pickle
import struct

import numpy as np
import pytest

from rapidtrain.data.indexed import (
    DataFileError,
    IndexedDataset,
    IndexedDatasetBuilder,
    LegacyIndexedDatasetBuilder,
    MissingDataFileError,
    best_dtype,
    dtype_code,
)

# Three documents: one sequence, an empty document, two sequences.
DOCUMENTS = [[[5, 6, 7]], [], [[8], [9, 10]]]


def build(prefix, documents=DOCUMENTS, dtype=np.uint16, builder_class=IndexedDatasetBuilder):
    builder = builder_class(str(prefix) + ".bin", dtype=dtype)
    for document in documents:
        builder.add_document(document)
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_mmap_files_match_the_spec_byte_for_byte(tmp_path):
    prefix = build(tmp_path / "data")
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 3)  # sequences
        + struct.pack("<Q", 4)  # document-index entries: 3 documents + 1
        + struct.pack("<3i", 3, 1, 2)  # lengths
        + struct.pack("<3q", 0, 6, 8)  # byte offsets: 2 bytes per uint16 token
        + struct.pack("<4q", 0, 1, 1, 3)  # the empty document repeats its boundary
    )
    assert read_bytes(prefix + ".idx") == expected_idx
    assert read_bytes(prefix + ".bin") == struct.pack("<6H", 5, 6, 7, 8, 9, 10)


def test_int32_tokens_use_code_4_and_four_byte_offsets(tmp_path):
    prefix = build(tmp_path / "data", [[[70000, 1]], [[2, 3, 4]]], dtype=best_dtype(70000))
    raw = read_bytes(prefix + ".idx")
    assert raw[17] == 4
    assert struct.unpack_from("<2q", raw, 34 + 8) == (0, 8)
    assert read_bytes(prefix + ".bin") == struct.pack("<5i", 70000, 1, 2, 3, 4)


def test_best_dtype_follows_megatron_threshold():
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32
    assert best_dtype(None) is np.int32
    assert [dtype_code(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64)] == [1, 2, 3, 4, 5]
    assert [dtype_code(t) for t in (np.float64, np.float32, np.uint16)] == [6, 7, 8]


def test_round_trip_gives_read_only_zero_copy_views(tmp_path):
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 50000, size=rng.integers(0, 40)) for _ in range(rng.integers(0, 3))]
        for _ in range(50)
    ]
    prefix = build(tmp_path / "data", documents)
    ds = IndexedDataset(prefix)
    sequences = [s for d in documents for s in d]
    assert len(ds) == len(sequences) and ds.dtype == np.uint16
    assert ds.sequence_lengths.dtype == np.int32 and ds.document_indices.dtype == np.int64
    assert ds.sequence_lengths.tolist() == [len(s) for s in sequences]
    assert ds.document_indices.tolist() == [0, *np.cumsum([len(d) for d in documents]).tolist()]
    for i, expected in enumerate(sequences):
        assert ds[i].tolist() == list(expected)
    longest = int(np.argmax(ds.sequence_lengths))
    assert ds.get(longest, 3, 5).tolist() == list(sequences[longest][3:8])
    assert ds.get(longest, 3).tolist() == list(sequences[longest][3:])
    assert ds[-1].tolist() == list(sequences[-1])
    assert [a.tolist() for a in ds[2:5]] == [list(s) for s in sequences[2:5]]
    view = ds[longest]
    assert not view.flags.writeable
    assert np.shares_memory(view, ds.get(longest, 1))  # both views of the one memory map


def test_get_outside_a_sequence_raises_index_error(tmp_path):
    ds = IndexedDataset(build(tmp_path / "data"))
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)  # sequence 0 has 3 tokens
    with pytest.raises(IndexError):
        ds.get(0, -1)


def test_add_documents_writes_the_same_bytes_as_add_document(tmp_path):
    one = build(tmp_path / "one")
    builder = IndexedDatasetBuilder(str(tmp_path / "many.bin"))
    builder.add_documents(np.array([5, 6, 7, 8, 9, 10]), [3, 1, 2], [1, 0, 2])
    builder.finalize(str(tmp_path / "many.idx"))
    for suffix in (".bin", ".idx"):
        assert read_bytes(one + suffix) == read_bytes(str(tmp_path / "many") + suffix)


def test_finalize_closes_an_open_document(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "data.bin"))
    builder.add_item([1, 2])
    builder.end_document()
    builder.add_item([3])
    builder.finalize(str(tmp_path / "data.idx"))
    assert IndexedDataset(str(tmp_path / "data")).document_indices.tolist() == [0, 1, 2]


def test_token_too_large_for_dtype_is_refused(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "data.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="70000 does not fit in uint16"):
        builder.add_item([1, 70000])
    builder.close()


def test_empty_dataset_reads_as_zero_sequences(tmp_path):
    prefix = build(tmp_path / "data", [[]])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and os.path.getsize(prefix + ".bin") == 0
    assert ds.document_indices.tolist() == [0, 0]


def test_legacy_files_match_the_spec_byte_for_byte(tmp_path):
    prefix = build(tmp_path / "data", dtype=np.int32, builder_class=LegacyIndexedDatasetBuilder)
    expected_idx = (
        b"TNTIDX\x00\x00"
        + struct.pack("<6Q", 1, 4, 4, 3, 3, 4)  # version, int32 code, element size, n, s, doc count
        + struct.pack("<4q", 0, 1, 2, 3)  # dim offsets
        + struct.pack("<4q", 0, 3, 4, 6)  # data offsets, in elements
        + struct.pack("<3q", 3, 1, 2)  # sizes
        + struct.pack("<4q", 0, 1, 1, 3)  # document index
    )
    assert read_bytes(prefix + ".idx") == expected_idx
    assert read_bytes(prefix + ".bin") == struct.pack("<6i", 5, 6, 7, 8, 9, 10)


@pytest.mark.parametrize("impl", ["lazy", "cached", "infer"])
def test_legacy_round_trip(tmp_path, impl):
    prefix = build(tmp_path / "data", dtype=np.uint16, builder_class=LegacyIndexedDatasetBuilder)
    ds = IndexedDataset(prefix, impl=impl)
    assert ds.impl == ("cached" if impl == "infer" else impl)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 6, 7], [8], [9, 10]]
    assert ds.get(0, 1, 1).tolist() == [6]
    assert ds.sequence_lengths.tolist() == [3, 1, 2] and ds.document_indices.tolist() == [0, 1, 1, 3]
    assert ds.dtype == np.uint16 and not ds[2].flags.writeable


def test_infer_picks_mmap_for_mmidx(tmp_path):
    assert IndexedDataset(build(tmp_path / "data"), impl="infer").impl == "mmap"


def test_pickled_dataset_reopens_its_files(tmp_path):
    for impl, builder_class in (("mmap", IndexedDatasetBuilder), ("lazy", LegacyIndexedDatasetBuilder)):
        prefix = build(tmp_path / impl, builder_class=builder_class)
        copy = pickle.loads(pickle.dumps(IndexedDataset(prefix, impl=impl)))
        assert copy.impl == impl and copy[2].tolist() == [9, 10]


def test_wrong_impl_names_the_flag_to_use(tmp_path):
    legacy = build(tmp_path / "legacy", builder_class=LegacyIndexedDatasetBuilder)
    with pytest.raises(DataFileError, match=r"legacy\.idx.*--data-impl lazy, cached or infer"):
        IndexedDataset(legacy, impl="mmap")
    with pytest.raises(DataFileError, match="--data-impl mmap or infer"):
        IndexedDataset(build(tmp_path / "mmap"), impl="lazy")


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file_is_named_with_prefix_hint(tmp_path, missing):
    prefix = build(tmp_path / "data")
    os.remove(prefix + missing)
    with pytest.raises(
        MissingDataFileError, match=rf"data\{missing} not found.*--data-path is a prefix"
    ) as err:
        IndexedDataset(prefix)
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)


def test_prefix_with_extension_suggests_dropping_it(tmp_path):
    prefix = build(tmp_path / "data")
    with pytest.raises(MissingDataFileError, match=f"drop the extension: {prefix}$"):
        IndexedDataset(prefix + ".bin")


def corrupt(path, offset=None, data=None, size=None):
    raw = bytearray(read_bytes(path))
    if data is not None:
        raw[offset : offset + len(data)] = data
    with open(path, "wb") as f:
        f.write(bytes(raw if size is None else raw[:size]))


CORRUPTIONS = {
    "bad magic": (".idx", dict(offset=0, data=b"NOTANIDX\x00"), r"data\.idx: bad magic"),
    "bad version": (".idx", dict(offset=9, data=struct.pack("<Q", 2)), r"data\.idx: bad version 2"),
    "unknown dtype": (".idx", dict(offset=17, data=b"\x09"), r"data\.idx: unknown dtype code 9"),
    "idx shorter than header": (".idx", dict(size=20), r"data\.idx: truncated: 20 bytes"),
    "idx truncated": (
        ".idx",
        dict(size=34 + 36 + 24),
        r"data\.idx: truncated: header says 3 sequences.*needs 102 bytes, but the file has 94",
    ),
    "bin truncated": (".bin", dict(size=10), r"data\.bin: truncated: the index needs 12 bytes"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_files_are_refused_naming_the_file(tmp_path, case):
    suffix, change, message = CORRUPTIONS[case]
    prefix = build(tmp_path / "data")
    corrupt(prefix + suffix, **change)
    with pytest.raises(DataFileError, match=message):
        IndexedDataset(prefix)


def test_legacy_truncated_index_is_refused(tmp_path):
    prefix = build(tmp_path / "data", builder_class=LegacyIndexedDatasetBuilder)
    corrupt(prefix + ".idx", size=56 + 8)
    with pytest.raises(DataFileError, match=r"data\.idx: truncated: header says 3 items"):
        IndexedDataset(prefix, impl="cached")
