"""The test vectors of docs/FORMAT.md, checked from Python with an XXH3 that
is independent of the Rust crate: the ``xxhash`` package (the reference C
implementation), not the crate's ``xxhash-rust``.

Like rust/tests/vectors.rs, this reads the hex dumps and field lists out of
the document itself. Every documented checksum is recomputed over the bytes
that FORMAT.md says it covers: the values in the field list, the values
stored in the dump, and the values quoted in the prose of §4.1. The field
offsets, and which header fields are read as zero, come from the table in
§1.2. The Python writer must also reproduce the v2 dump byte for byte, as the
Rust writer does in vectors.rs. The last tests edit a copy of the document
and check that a wrong documented value fails.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import xxhash

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
V2_FIXED = 96
ALIGN = 64


def format_md() -> str:
    return FORMAT_MD.read_text(encoding="utf-8")


def xxh3_64(data: bytes) -> int:
    """XXH3 64-bit with seed 0 (``XXH3_64bits``), as §1.3 specifies."""
    return xxhash.xxh3_64_intdigest(data, seed=0)


# ---- reading the document (the same rules as rust/tests/vectors.rs) ----


def block(doc: str, vid: str) -> str:
    """The fenced block between ``<!-- vector:{vid} -->`` and ``<!-- /vector -->``."""
    start = f"<!-- vector:{vid} -->"
    assert start in doc, f"no {start} in FORMAT.md"
    body = doc.split(start, 1)[1]
    assert "<!-- /vector -->" in body, f"{start} is not closed"
    body = body.split("<!-- /vector -->", 1)[0].strip()
    for fence in ("```text", "```"):
        if body.startswith(fence):
            body = body[len(fence) :]
            break
    else:
        raise AssertionError(f"{start}: not a fenced block")
    assert body.endswith("```"), f"{start}: no closing fence"
    return body[: -len("```")].strip("\n")


def parse_xxd(dump: str) -> bytes:
    """An ``xxd`` dump: the offset, then up to 16 bytes as hex in the first 39
    columns after ": "; the ASCII column is ignored. Offsets must be contiguous."""
    out = bytearray()
    for line in dump.splitlines():
        off, sep, rest = line.partition(": ")
        assert sep, f"bad xxd line {line!r}"
        assert int(off, 16) == len(out), f"xxd offsets must be contiguous at {line!r}"
        chunk = bytes.fromhex("".join(rest[:39].split()))
        assert 0 < len(chunk) <= 16, line
        out += chunk
    return bytes(out)


def parse_fields(text: str) -> list[tuple[str, str]]:
    pairs = []
    for line in text.splitlines():
        if line.strip():
            k, sep, v = line.partition(" = ")
            assert sep, f"bad field line {line!r}"
            pairs.append((k.strip(), v.strip()))
    return pairs


def fields_dict(doc: str, vid: str) -> dict[str, str]:
    """The field list as a dict (the repeated ``tensor`` lines are left out)."""
    return {k: v for k, v in parse_fields(block(doc, vid)) if k != "tensor"}


def section(doc: str, start: str, end: str) -> str:
    assert start in doc, f"no {start!r} in FORMAT.md"
    rest = doc.split(start, 1)[1]
    assert end in rest, f"no {end!r} after {start!r} in FORMAT.md"
    return rest.split(end, 1)[0]


def header_table(doc: str) -> dict[str, tuple[int, int, bool]]:
    """§1.2's table: field name -> (offset, size, covered by the header checksum)."""
    rows = {}
    for line in section(doc, "### 1.2 Fixed header", "### 1.3").splitlines():
        cells = [c.strip().replace("*", "").strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].isdigit():
            continue  # the heading and separator rows, the text around the table
        offset, size, _type, name, _meaning, covered = cells
        assert covered in ("yes", "no (read as zero)"), line
        key = f"{name}@{offset}" if name == "reserved" else name
        rows[key] = (int(offset), int(size), covered == "yes")
    return rows


def u(data: bytes, at: int, size: int) -> int:
    return int.from_bytes(data[at : at + size], "little")


def hex_u64(v: int) -> str:
    """The field lists' spelling of a u64 (Rust's ``{:#018x}``)."""
    return f"{v:#018x}"


# ---- the checks ----


def check_v2(doc: str) -> None:
    data = parse_xxd(block(doc, "v2:hex"))
    fields = fields_dict(doc, "v2:fields")
    table = header_table(doc)

    def field_at(name: str) -> int:
        off, size, _ = table[name]
        return u(data, off, size)

    # The 96-byte header covers the whole table, without gaps or overlaps.
    spans = sorted((off, size) for off, size, _ in table.values())
    pos = 0
    for off, size in spans:
        assert off == pos, f"§1.2 table: a gap or overlap at offset {off}"
        pos += size
    assert pos == V2_FIXED

    # Sections (§1.1), from the documented bytes.
    meta_bytes = field_at("meta_bytes")
    text_bytes = field_at("text_bytes")
    payload_bytes = field_at("payload_bytes")
    text_offset = V2_FIXED + meta_bytes
    payload_offset = -(-(text_offset + text_bytes) // ALIGN) * ALIGN
    assert len(data) == payload_offset + payload_bytes == int(fields["file_len"])
    assert text_offset == int(fields["text_offset"])
    assert payload_offset == int(fields["payload_offset"])
    assert payload_bytes == int(fields["payload_bytes"])

    # §1.6: the whole payload section, padding included.
    payload_sum = xxh3_64(data[payload_offset : payload_offset + payload_bytes])
    assert hex_u64(field_at("payload_checksum")) == hex_u64(payload_sum), "stored payload_checksum"
    assert fields["payload_checksum"] == hex_u64(payload_sum), "listed payload_checksum"

    # §1.3: the fixed header with the fields that §1.2 marks "read as zero"
    # zeroed, then the metadata. §1.3 names the same bytes.
    zeroed = sorted((off, off + size) for off, size, covered in table.values() if not covered)
    formula = " ".join(section(doc, "### 1.3 Header checksum", "### 1.4").split())
    m = re.search(r"bytes (\d+)\.\.(\d+), (\d+)\.\.(\d+) and (\d+)\.\.(\d+) set to zero", formula)
    assert m, "§1.3: no header checksum formula"
    g = [int(x) for x in m.groups()]
    assert zeroed == [(g[0], g[1]), (g[2], g[3]), (g[4], g[5])], "§1.2 and §1.3 disagree"
    covered = bytearray(data[:V2_FIXED])
    for a, b in zeroed:
        covered[a:b] = bytes(b - a)
    header_sum = xxh3_64(bytes(covered) + data[V2_FIXED:text_offset])
    assert hex_u64(field_at("header_checksum")) == hex_u64(header_sum), "stored header_checksum"
    assert fields["header_checksum"] == hex_u64(header_sum), "listed header_checksum"

    # §1.5: the text's SHA-1 is stored in the header and names the file.
    text = data[text_offset : text_offset + text_bytes]
    off, size, _ = table["text_sha1"]
    assert data[off : off + size].hex() == hashlib.sha1(text).hexdigest(), "stored text_sha1"
    assert fields["text_sha1"] == hashlib.sha1(text).hexdigest(), "listed text_sha1"
    assert fields["name"] == hashlib.sha1(text).hexdigest() + ".kv"
    assert fields["text"].encode() == text

    # §4.1's prose quotes both checksums with the byte ranges they cover
    # (inclusive): the ranges must be the ones above, the values what XXH3
    # gives over them.
    prose = " ".join(section(doc, "### 4.1 v2", "<!-- vector:v2:fields -->").split())
    rng = r"(0x[0-9a-f]+)-(0x[0-9a-f]+)"
    m = re.search(
        rf"Header checksum, computed over bytes {rng} with {rng}, {rng} and {rng} "
        r"read as zero: `(0x[0-9a-f]+)`",
        prose,
    )
    assert m, "§4.1: no header checksum sentence"
    r = [int(x, 16) for x in m.groups()[:8]]
    assert (r[0], r[1] + 1) == (0, text_offset), "§4.1: header checksum range"
    zero_ranges = [(r[2], r[3] + 1), (r[4], r[5] + 1), (r[6], r[7] + 1)]
    assert zero_ranges == zeroed, "§4.1: ranges read as zero"
    quoted = bytearray(data[r[0] : r[1] + 1])
    for a, b in zero_ranges:
        quoted[a:b] = bytes(b - a)
    assert m.group(9) == hex_u64(xxh3_64(bytes(quoted))), "§4.1: quoted header checksum"
    m = re.search(rf"Payload checksum, computed over bytes {rng}: `(0x[0-9a-f]+)`", prose)
    assert m, "§4.1: no payload checksum sentence"
    a, b = int(m.group(1), 16), int(m.group(2), 16) + 1
    assert (a, b) == (payload_offset, payload_offset + payload_bytes), "§4.1: payload checksum range"
    assert m.group(3) == hex_u64(xxh3_64(data[a:b])), "§4.1: quoted payload checksum"


def check_v1(doc: str) -> None:
    # v1 has no checksum; the file name (SHA-1 of the text) is its only integrity check.
    data = parse_xxd(block(doc, "v1:hex"))
    fields = fields_dict(doc, "v1:fields")
    assert len(data) == int(fields["file_len"])
    text_bytes = u(data, 48, 4)
    text = data[52 : 52 + text_bytes]
    assert text_bytes == int(fields["text_bytes"])
    assert text == fields["text"].encode()
    assert fields["name"] == hashlib.sha1(text).hexdigest() + ".kv"


# ---- tests ----


def test_xxh3_known_answer():
    # The published XXH3_64bits("") with seed 0, also asserted for the Rust
    # test encoder (rust/tests/vectors.rs).
    assert xxh3_64(b"") == 0x2D06800538D394C2


def test_v2_documented_checksums_are_xxh3_of_the_documented_bytes():
    check_v2(format_md())


def test_v1_name_is_the_sha1_of_the_text():
    check_v1(format_md())


def test_python_writer_reproduces_the_v2_dump(tmp_path):
    import numpy as np

    import ds4

    doc = format_md()
    expected = parse_xxd(block(doc, "v2:hex"))
    fields = fields_dict(doc, "v2:fields")
    # The writer input listed in §4.1.
    text = b"Hello, ds4!"
    arrays = {"logits": np.array([1, 2, 3, 4], dtype=np.float32), "blob": b"xyz"}
    path = tmp_path / (hashlib.sha1(text).hexdigest() + ".kv")
    assert path.name == fields["name"]
    size = ds4.write_checkpoint(
        path,
        text,
        arrays,
        abi="test/1",
        tokens=3,
        ctx=4096,
        reason="cold",
        quant_bits=0,
        flags=0,
        created=1_700_000_000,
    )
    written = path.read_bytes()
    assert size == len(expected)
    assert written.hex() == expected.hex(), "the Python writer's output differs from the FORMAT.md dump"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# Each edit makes one documented value wrong, in a copy of the document.
def _bump_hex_digit(m: re.Match) -> str:
    s = m.group(0)
    return s[:-1] + ("0" if s[-1] != "0" else "1")


# what -> (the edit, the check that must catch it)
WRONG = {
    "listed header_checksum": (
        lambda d: re.sub(r"(?m)^header_checksum\s+= 0x[0-9a-f]{16}", _bump_hex_digit, d),
        "listed header_checksum",
    ),
    "listed payload_checksum": (
        lambda d: re.sub(r"(?m)^payload_checksum\s+= 0x[0-9a-f]{16}", _bump_hex_digit, d),
        "listed payload_checksum",
    ),
    "stored header_checksum": (
        lambda d: d.replace("00000050: 9247 c19a 598c 734b aaa0", "00000050: 9247 c19a 598c 734b aba0"),
        "stored header_checksum",
    ),
    "stored payload_checksum": (
        lambda d: d.replace("00000050: 9247", "00000050: 9347"),
        "stored payload_checksum",
    ),
    "quoted header checksum": (
        lambda d: re.sub(r"read as zero: `0x[0-9a-f]{16}", _bump_hex_digit, d),
        "§4.1: quoted header checksum",
    ),
    "quoted payload checksum": (
        lambda d: re.sub(r"over bytes 0xc0-0x102: `0x[0-9a-f]{16}", _bump_hex_digit, d),
        "§4.1: quoted payload checksum",
    ),
    "a covered header byte (ctx)": (
        lambda d: d.replace("00000010: 0010 0000", "00000010: 0011 0000"),
        "stored header_checksum",
    ),
    "a metadata byte": (
        lambda d: d.replace("00000090: 0001 0300", "00000090: 0001 0400"),
        "stored header_checksum",
    ),
    "a payload padding byte": (
        lambda d: d.replace("000000d0: 0000 0000", "000000d0: 0000 0100"),
        "stored payload_checksum",
    ),
    "a payload byte": (
        lambda d: d.replace("00000100: 7879 7a", "00000100: 7879 7b"),
        "stored payload_checksum",
    ),
    "the quoted payload range": (
        lambda d: d.replace("over bytes 0xc0-0x102", "over bytes 0xc0-0x101"),
        "§4.1: payload checksum range",
    ),
    "a range read as zero in §1.3": (
        lambda d: d.replace("bytes 12..16, 32..40 and 88..96", "bytes 12..16, 32..40 and 80..96"),
        "§1.2 and §1.3 disagree",
    ),
    "the table's covered column (hits)": (
        lambda d: re.sub(r"(?m)^(\| \*\*12\*\* \|.*\| )\*\*no \(read as zero\)\*\* \|$", r"\1yes |", d),
        "§1.2 and §1.3 disagree",
    ),
}


@pytest.mark.parametrize("what", list(WRONG))
def test_a_wrong_documented_value_fails(what):
    edit, caught_by = WRONG[what]
    doc = format_md()
    wrong = edit(doc)
    assert wrong != doc, f"the edit for {what!r} no longer applies to FORMAT.md"
    with pytest.raises(AssertionError, match=re.escape(caught_by)):
        check_v2(wrong)


def test_the_mutable_fields_are_outside_the_header_checksum():
    # The other way round: new hits and last_used values in the dump keep
    # every checksum valid, since §1.2 reads them as zero.
    doc = format_md()
    edited = doc.replace(
        "00000000: 4b56 4302 0001 0000 0300 0000 0000 0000",
        "00000000: 4b56 4302 0001 0000 0300 0000 0700 0000",
    ).replace("00000020: 00f1 5365", "00000020: 99f1 5365")
    assert edited.count("0700 0000") > doc.count("0700 0000") and "99f1 5365" in edited
    check_v2(edited)


# ---- §4.4: v3 (zstd frames), with the zstandard package's C zstd ----


def test_v3_vector_frames_and_checksums_from_the_documented_bytes():
    """Every documented v3 value recomputed from the dump: the header
    checksum over the fixed header and the metadata (frame table included),
    the payload checksum over the stored frames, each frame decompressed
    with the zstandard package to the shuffle2 of its span of §4.1's raw
    payload, whose C XXH3 is the table's."""
    import zstandard

    doc = format_md()
    b = parse_xxd(block(doc, "v3:hex"))
    f = fields_dict(doc, "v3:fields")
    assert b[3] == 3 and (b[53], b[54], b[55]) == (1, 1, 1) and u(b, 76, 4) == int(f["span"])
    meta_len = u(b, 20, 4)
    fixed = bytearray(b[:V2_FIXED])
    for lo, hi in ((12, 16), (32, 40), (88, 96)):
        fixed[lo:hi] = bytes(hi - lo)
    hsum = xxh3_64(bytes(fixed) + b[V2_FIXED : V2_FIXED + meta_len])
    assert hex_u64(hsum) == f["header_checksum"] and u(b, 88, 8) == hsum
    po = int(f["payload_offset"])
    assert po == -(-(V2_FIXED + meta_len + int(f["text_bytes"])) // ALIGN) * ALIGN
    assert len(b) == po + u(b, 40, 8) == int(f["file_len"])
    assert hex_u64(xxh3_64(b[po:])) == f["payload_checksum"] == hex_u64(u(b, 80, 8))
    v2 = parse_xxd(block(doc, "v2:hex"))
    raw = v2[len(v2) - u(v2, 40, 8) :]  # §4.1's payload: the same tensors
    span = u(b, 76, 4)
    n_at = V2_FIXED + u(v2, 20, 4)  # the frame table follows §4.1's metadata
    n, table = u(b, n_at, 4), n_at + 4
    assert n == 2 and table + 16 * n == V2_FIXED + meta_len
    at = po
    listed = [line for k, line in parse_fields(block(doc, "v3:fields")) if k == "frame"]
    for i in range(n):
        stored, rlen, h = u(b, table + 16 * i, 4), u(b, table + 16 * i + 4, 4), u(b, table + 16 * i + 8, 8)
        assert listed[i] == f"stored={stored} raw={rlen} raw_xxh3={hex_u64(h)}"
        piece = raw[i * span : i * span + rlen]
        assert xxh3_64(piece) == h
        got = zstandard.ZstdDecompressor().decompress(b[at : at + stored])
        assert got == piece[0::2] + piece[1::2]
        at += stored
    assert at == len(b) and len(raw) == int(f["raw_payload_bytes"])


def test_python_writer_reproduces_the_v3_dump(tmp_path):
    import numpy as np

    from ds4 import _core
    from ds4.checkpoint import _tensor_entry

    doc = format_md()
    want = parse_xxd(block(doc, "v3:hex"))
    f = fields_dict(doc, "v3:fields")
    path = tmp_path / f["name"]
    tensors = [_tensor_entry("logits", np.array([1, 2, 3, 4], dtype=np.float32)), _tensor_entry("blob", b"xyz")]
    _core.write_checkpoint(
        str(path), b"Hello, ds4!", tensors, abi="test/1", tokens=3, ctx=4096, reason=1, created=1_700_000_000,
        codec="zstd", level=1, filter="shuffle2", span=64,
    )  # fmt: skip
    assert path.read_bytes() == want


def test_file_name_vector():
    """§5's name vector: the SHA-1 of the text, the model tag of the ABI (the
    first 8 bytes of its SHA-1), both names, from the library and by hand."""
    from ds4 import _core
    from ds4.kvstore import checkpoint_name, is_checkpoint_name
    from ds4.kvstore.files import legacy_name

    f = fields_dict(format_md(), "name")
    text, abi = f["text"].encode(), f["abi"]
    assert hashlib.sha1(text).hexdigest() == f["sha1"] == _core.sha1_hex(text)
    assert hashlib.sha1(abi.encode()).hexdigest()[:16] == f["tag"] == _core.model_tag(abi)
    assert checkpoint_name(f["sha1"], abi) == f["name"] and legacy_name(f["sha1"]) == f["old name"]
    assert is_checkpoint_name(f["name"]) and is_checkpoint_name(f["old name"])
    assert not is_checkpoint_name(f["name"].replace(f["tag"], f["tag"].upper()))
