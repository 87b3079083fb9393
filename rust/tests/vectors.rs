//! The test vectors of docs/FORMAT.md, read from the document itself: the
//! writer must produce exactly the v2 bytes, and the reader must return the
//! listed fields for both vectors. Editing the format without the document
//! (or the document without the format) fails here. The documented checksums
//! are recomputed with an XXH3 independent of the crate's (see
//! `common::xxh3_64`), so the crate's checksum functions are checked, not
//! trusted.
//! (That XXH3 is checked against the crate's in `vectors_xxh3.rs`.)

mod common;

use ds4::format::v1::DSV4_FIELDS;
use ds4::{open, Dtype, Header, TensorSrc, VerifyOptions, WriteMeta, WriteOptions};
use std::path::{Path, PathBuf};

fn format_md() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/FORMAT.md");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// The text of the fenced block between `<!-- vector:{id} -->` and `<!-- /vector -->`.
fn block(doc: &str, id: &str) -> String {
    let start = format!("<!-- vector:{id} -->");
    let (_, rest) = doc
        .split_once(&start)
        .unwrap_or_else(|| panic!("no {start} in FORMAT.md"));
    let (body, _) = rest
        .split_once("<!-- /vector -->")
        .unwrap_or_else(|| panic!("{start} is not closed"));
    let body = body.trim();
    let body = body
        .strip_prefix("```text")
        .or_else(|| body.strip_prefix("```"))
        .expect("fenced block");
    body.strip_suffix("```")
        .expect("closing fence")
        .trim_matches('\n')
        .to_owned()
}

/// Parses an `xxd` dump: offset, then up to 16 bytes as hex in the first 39
/// columns after ": "; the ASCII column is ignored. Offsets must be contiguous.
fn parse_xxd(dump: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in dump.lines() {
        let (off, rest) = line
            .split_once(": ")
            .unwrap_or_else(|| panic!("bad xxd line {line:?}"));
        let off = usize::from_str_radix(off, 16).unwrap();
        assert_eq!(off, out.len(), "xxd offsets must be contiguous at {line:?}");
        let hexcols: String = rest
            .chars()
            .take(39)
            .filter(|c| !c.is_whitespace())
            .collect();
        let bytes = hex::decode(&hexcols).unwrap_or_else(|e| panic!("bad hex in {line:?}: {e}"));
        assert!(bytes.len() <= 16 && !bytes.is_empty(), "{line:?}");
        out.extend_from_slice(&bytes);
    }
    out
}

fn parse_fields(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l
                .split_once(" = ")
                .unwrap_or_else(|| panic!("bad field line {l:?}"));
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

/// Compares every listed field with the reader's value; unknown keys fail.
fn check_fields(
    fields: &[(String, String)],
    path: &Path,
    h: &Header,
    text: &[u8],
    file_len: u64,
    dsv4: Option<[u32; 13]>,
) {
    let mut tensors_listed = Vec::new();
    let mut frames_listed = Vec::new();
    for (k, v) in fields {
        let got: String = match k.as_str() {
            "name" => path.file_name().unwrap().to_str().unwrap().to_owned(),
            "file_len" => file_len.to_string(),
            "version" => h.version.to_string(),
            "quant_bits" => h.quant_bits.to_string(),
            "reason" => h.reason.to_string(),
            "flags" => h.flags.to_string(),
            "tokens" => h.tokens.to_string(),
            "hits" => h.hits.to_string(),
            "ctx" => h.ctx.to_string(),
            "created" => h.created.to_string(),
            "last_used" => h.last_used.to_string(),
            "text_bytes" => h.text_bytes.to_string(),
            "text" => String::from_utf8(text.to_vec()).unwrap(),
            "text_sha1" => ds4::hash::to_hex(&h.text_sha1.expect("v2 has text_sha1")),
            "abi" => h.abi.clone(),
            "text_offset" => h.text_offset.to_string(),
            "payload_offset" => h.payload_offset.to_string(),
            "payload_bytes" => h.payload_bytes.to_string(),
            "payload_checksum" => format!("{:#018x}", h.payload_checksum),
            "header_checksum" => format!("{:#018x}", h.header_checksum),
            "trailer_bytes" => h.trailer_bytes.to_string(),
            "raw_payload_bytes" => h.raw_payload_bytes.to_string(),
            "codec" => h.codec.as_ref().expect("v3").codec.to_string(),
            "filter" => h.codec.as_ref().expect("v3").filter.to_string(),
            "level" => h.codec.as_ref().expect("v3").level.to_string(),
            "span" => h.codec.as_ref().expect("v3").span.to_string(),
            "frame" => {
                frames_listed.push(v.clone());
                continue;
            }
            "tensor" => {
                tensors_listed.push(v.clone());
                continue;
            }
            k if k.starts_with("dsv4.") => {
                let f = &k["dsv4.".len()..];
                let i = DSV4_FIELDS
                    .iter()
                    .position(|n| *n == f)
                    .unwrap_or_else(|| panic!("unknown DSV4 field {f}"));
                let val = dsv4.expect("DSV4 fields decoded")[i];
                if f == "magic" {
                    format!("{val:#010x}")
                } else {
                    val.to_string()
                }
            }
            other => panic!("FORMAT.md lists field {other:?} which the vector test does not know"),
        };
        assert_eq!(&got, v, "field {k}");
    }
    let tensors_read: Vec<String> = h
        .tensors
        .iter()
        .map(|t| {
            format!(
                "{} {} {:?} offset={} nbytes={}",
                t.name,
                dtype_name(t.dtype),
                t.shape,
                t.offset,
                t.nbytes
            )
        })
        .collect();
    assert_eq!(tensors_read, tensors_listed, "tensor table");
    let frames_read: Vec<String> = h
        .codec
        .iter()
        .flat_map(|c| &c.frames)
        .map(|f| {
            format!(
                "stored={} raw={} raw_xxh3={:#018x}",
                f.stored, f.raw, f.hash
            )
        })
        .collect();
    assert_eq!(frames_read, frames_listed, "frame table");
}

fn write_bytes(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> &'a str {
    &fields
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no field {key}"))
        .1
}

#[test]
fn v2_vector_writer_produces_the_documented_bytes() {
    let doc = format_md();
    let expected = parse_xxd(&block(&doc, "v2:hex"));
    let fields = parse_fields(&block(&doc, "v2:fields"));
    let dir = tempfile::tempdir().unwrap();

    let text = b"Hello, ds4!";
    let logits: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let meta = WriteMeta {
        quant_bits: 0,
        reason: 1,
        flags: 0,
        tokens: 3,
        ctx: 4096,
        created: 1_700_000_000,
        abi: "test/1".into(),
    };
    let tensors = [
        TensorSrc {
            name: "logits",
            dtype: Dtype::F32,
            shape: &[4],
            data: &logits,
        },
        TensorSrc {
            name: "blob",
            dtype: Dtype::U8,
            shape: &[3],
            data: b"xyz",
        },
    ];
    let name = format!("{}.kv", ds4::hash::sha1_hex(text));
    assert_eq!(name, field(&fields, "name"));
    let path = dir.path().join(&name);
    let w = ds4::write_checkpoint(&path, &meta, text, &tensors, &WriteOptions::default()).unwrap();
    let written = std::fs::read(&path).unwrap();
    assert_eq!(
        hex::encode(&written),
        hex::encode(&expected),
        "writer output differs from the FORMAT.md dump"
    );
    assert_eq!(w.file_len, expected.len() as u64);
    assert_eq!(
        format!("{:#018x}", w.header_checksum),
        field(&fields, "header_checksum")
    );
    assert_eq!(
        format!("{:#018x}", w.payload_checksum),
        field(&fields, "payload_checksum")
    );

    // The checksums follow from their documented definitions (§1.3, §1.6),
    // computed with the independent XXH3 over the documented bytes: the
    // listed values, the stored fields and the crate's functions all agree.
    let meta_len = u32::from_le_bytes(expected[20..24].try_into().unwrap()) as usize;
    let payload_len =
        usize::try_from(u64::from_le_bytes(expected[40..48].try_into().unwrap())).unwrap();
    let po = common::payload_offset(&expected);
    assert_eq!(po + payload_len, expected.len());
    let hsum = common::independent_header_checksum(&expected[..96], &expected[96..96 + meta_len]);
    let psum = common::independent_payload_checksum(&expected[po..]);
    assert_eq!(format!("{hsum:#018x}"), field(&fields, "header_checksum"));
    assert_eq!(format!("{psum:#018x}"), field(&fields, "payload_checksum"));
    assert_eq!(
        hsum,
        u64::from_le_bytes(expected[88..96].try_into().unwrap())
    );
    assert_eq!(
        psum,
        u64::from_le_bytes(expected[80..88].try_into().unwrap())
    );
    assert_eq!(
        ds4::format::v2::header_checksum(&expected[..96], &expected[96..96 + meta_len]),
        hsum
    );
    assert_eq!(ds4::format::v2::payload_checksum(&expected[po..]), psum);

    // The reader, from the documented bytes (both modes), yields the listed fields.
    for mmap in [true, false] {
        let dir2 = tempfile::tempdir().unwrap();
        let p = write_bytes(dir2.path(), &name, &expected);
        let ck = open(
            &p,
            &VerifyOptions {
                mmap,
                expected_abi: Some("test/1"),
                prompt: Some(b"Hello, ds4! more"),
                ..Default::default()
            },
        )
        .unwrap();
        check_fields(&fields, &p, &ck.header, &ck.text, ck.file_len, ck.dsv4);
        let payload = ck.payload().unwrap();
        assert_eq!(&payload[..16], &logits[..]);
        assert_eq!(&payload[64..67], b"xyz");
        assert_eq!(payload.as_ptr() as usize % 64, 0);
    }
}

/// §4.4: the writer produces the documented v3 bytes; the reader returns
/// the listed fields and §4.1's payload; the checksums follow from their
/// definitions (independent XXH3), and each frame is a zstd frame of its
/// shuffled raw bytes.
#[test]
fn v3_vector_writer_produces_the_documented_bytes() {
    use ds4::{write_checkpoint, Compression};
    let doc = format_md();
    let expected = parse_xxd(&block(&doc, "v3:hex"));
    let fields = parse_fields(&block(&doc, "v3:fields"));
    let dir = tempfile::tempdir().unwrap();
    let text = b"Hello, ds4!";
    let logits: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let meta = WriteMeta {
        quant_bits: 0,
        reason: 1,
        flags: 0,
        tokens: 3,
        ctx: 4096,
        created: 1_700_000_000,
        abi: "test/1".into(),
    };
    let tensors = [
        TensorSrc {
            name: "logits",
            dtype: Dtype::F32,
            shape: &[4],
            data: &logits,
        },
        TensorSrc {
            name: "blob",
            dtype: Dtype::U8,
            shape: &[3],
            data: b"xyz",
        },
    ];
    let name = format!("{}.kv", ds4::hash::sha1_hex(text));
    assert_eq!(name, field(&fields, "name"));
    let path = dir.path().join(&name);
    let c = Compression {
        level: 1,
        shuffle: true,
        span: 64,
    };
    let w = write_checkpoint(
        &path,
        &meta,
        text,
        &tensors,
        &WriteOptions {
            auth_key: None,
            drop_cache: true,
            compression: Some(c),
        },
    )
    .unwrap();
    assert_eq!(
        hex::encode(std::fs::read(&path).unwrap()),
        hex::encode(&expected),
        "writer output differs from the FORMAT.md dump"
    );
    assert_eq!(w.file_len, expected.len() as u64);

    let meta_len = u32::from_le_bytes(expected[20..24].try_into().unwrap()) as usize;
    let po = common::payload_offset(&expected);
    let hsum = common::independent_header_checksum(&expected[..96], &expected[96..96 + meta_len]);
    let psum = common::independent_payload_checksum(&expected[po..]);
    assert_eq!(format!("{hsum:#018x}"), field(&fields, "header_checksum"));
    assert_eq!(format!("{psum:#018x}"), field(&fields, "payload_checksum"));

    // The raw payload is §4.1's; each frame is a zstd frame of its span of
    // it after shuffle2, and the table's hashes are those spans' XXH3.
    let v2 = parse_xxd(&block(&doc, "v2:hex"));
    let raw = &v2[common::payload_offset(&v2)..];
    let ck = open(&path, &VerifyOptions::default()).unwrap();
    let codec = ck.header.codec.clone().unwrap();
    let mut at = po;
    for (i, f) in codec.frames.iter().enumerate() {
        let span = &raw[i * 64..i * 64 + f.raw as usize];
        assert_eq!(common::xxh3_64(span), f.hash, "frame {i} hash");
        let z = &expected[at..at + f.stored as usize];
        let got = zstd::bulk::decompress(z, 64).unwrap();
        let mut shuffled: Vec<u8> = span.iter().step_by(2).copied().collect();
        shuffled.extend(span.iter().skip(1).step_by(2));
        assert_eq!(got, shuffled, "frame {i}");
        at += f.stored as usize;
    }
    assert_eq!(at, expected.len());

    for mmap in [true, false] {
        let dir2 = tempfile::tempdir().unwrap();
        let p = write_bytes(dir2.path(), &name, &expected);
        let ck = open(
            &p,
            &VerifyOptions {
                mmap,
                expected_abi: Some("test/1"),
                prompt: Some(b"Hello, ds4! more"),
                ..Default::default()
            },
        )
        .unwrap();
        check_fields(&fields, &p, &ck.header, &ck.text, ck.file_len, ck.dsv4);
        assert_eq!(ck.payload().unwrap(), raw);
        assert_eq!(ck.payload().unwrap().as_ptr() as usize % 64, 0);
    }
}

#[test]
fn v1_vector_reads_as_documented() {
    let doc = format_md();
    let bytes = parse_xxd(&block(&doc, "v1:hex"));
    let fields = parse_fields(&block(&doc, "v1:fields"));
    let dir = tempfile::tempdir().unwrap();
    let text = field(&fields, "text").as_bytes();
    let name = format!("{}.kv", ds4::hash::sha1_hex(text));
    assert_eq!(name, field(&fields, "name"));
    for mmap in [true, false] {
        let p = write_bytes(dir.path(), &name, &bytes);
        let ck = open(
            &p,
            &VerifyOptions {
                mmap,
                prompt: Some(b"Hello, v1! and more"),
                ..Default::default()
            },
        )
        .unwrap();
        check_fields(&fields, &p, &ck.header, &ck.text, ck.file_len, ck.dsv4);
        let payload = ck.payload().unwrap();
        assert_eq!(payload.len(), 60);
        assert_eq!(&payload[..4], b"DSV4");
        assert_eq!(
            u32::from_le_bytes(payload[52..56].try_into().unwrap()),
            9906
        );
        assert_eq!(u32::from_le_bytes(payload[56..60].try_into().unwrap()), 11);
        assert_eq!(
            &bytes[bytes.len() - usize::try_from(ck.header.trailer_bytes).unwrap()..][..3],
            b"KTM"
        );
    }
    // Header-only open decodes the DSV4 fields too.
    let p = dir.path().join(&name);
    let ck = open(
        &p,
        &VerifyOptions {
            load_payload: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(ck.storage.is_none());
    assert_eq!(ck.dsv4.unwrap()[7], 2);
    // A v1 file never satisfies a v2 ABI.
    let e = open(
        &p,
        &VerifyOptions {
            expected_abi: Some("test/1"),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.code(), "abi_mismatch");
}

#[test]
fn xxd_parser_round_trips_its_own_output_shape() {
    // Guard the parser: a 3-byte last line and a full line.
    let d = "00000000: 0001 0203 0405 0607 0809 0a0b 0c0d 0e0f  ................\n00000010: 7879 7a                                  xyz";
    let b = parse_xxd(d);
    assert_eq!(b.len(), 19);
    assert_eq!(&b[16..], b"xyz");
}
