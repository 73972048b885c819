//! GGUF v2/v3 reader (memory-mapped, every offset and size validated) and writer.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Result, TextError};
use crate::ggml::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
const MAX_DIMS: usize = 4;
const MAX_ARRAY_DEPTH: usize = 2;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Unsigned integer of any width.
    U64(u64),
    /// Signed integer of any width.
    I64(i64),
    /// Float of any width.
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U64(v) => Some(v),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as GGUF stores them.
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Size of the data in bytes.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key-values.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str) -> TextError {
        TextError::format(self.path, format!("{what} (at byte {})", self.pos))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(&format!("truncated while reading {what}"))),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| self.err(&format!("{what} {n} is too large")))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(&format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U64(u64::from(self.array::<1>(key)?[0])),
            1 => MetaValue::I64(i64::from(self.array::<1>(key)?[0] as i8)),
            2 => MetaValue::U64(u64::from(u16::from_le_bytes(self.array(key)?))),
            3 => MetaValue::I64(i64::from(i16::from_le_bytes(self.array(key)?))),
            4 => MetaValue::U64(u64::from(self.u32(key)?)),
            5 => MetaValue::I64(i64::from(i32::from_le_bytes(self.array(key)?))),
            6 => MetaValue::F64(f64::from(f32::from_le_bytes(self.array(key)?))),
            7 => MetaValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(&format!("metadata {key}: arrays nested too deep")));
                }
                let elem_ty = self.u32(key)?;
                let n = self.len(key)?;
                // Every element takes at least one byte: refuse counts the file cannot hold
                // before allocating for them.
                if n > self.buf.len() - self.pos {
                    return Err(self.err(&format!("metadata {key}: array length {n} exceeds file")));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.err(&format!("metadata {key}: unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| TextError::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated underneath us by another process is
        // outside what any mmap-based loader can defend against (llama.cpp and safetensors
        // make the same assumption).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| TextError::io(path, e))?;
        Self::parse(path, Arc::new(mmap))
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<GgufFile> {
        let mut c = Cursor { buf: &mmap[..], pos: 0, path };
        if c.take(4, "magic")? != MAGIC {
            return Err(TextError::format(path, "not a GGUF file (bad magic)"));
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(TextError::format(path, format!("unsupported GGUF version {version}")));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        // A tensor info and a key-value take at least 8 bytes each.
        if n_tensors.saturating_add(n_kv) > c.buf.len() / 8 {
            return Err(TextError::format(path, "tensor or metadata count exceeds file size"));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .and_then(|a| usize::try_from(a).ok())
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| {
                    TextError::format(path, "general.alignment is not a power of two")
                })?,
        };
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(TextError::format(path, format!("tensor {name}: {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.len(&name)?);
            }
            let ty_id = c.u32(&name)?;
            let offset = c.len(&name)?;
            raw.push((name, dims, ty_id, offset));
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let file_len = mmap.len();
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty_id, rel) in raw {
            let fail = |m: String| TextError::format(path, format!("tensor {name}: {m}"));
            let ty = GgmlType::from_gguf_id(ty_id)
                .ok_or_else(|| fail(format!("unsupported tensor type id {ty_id}")))?;
            let elems = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| fail("element count overflows".into()))?;
            let row = dims[0];
            let row_bytes = ty.row_bytes(row).ok_or_else(|| {
                fail(format!("row of {row} is not a whole number of {} blocks", ty.name()))
            })?;
            let size = elems
                .checked_div(row)
                .map_or(Some(0), |rows| rows.checked_mul(row_bytes))
                .ok_or_else(|| fail("size overflows".into()))?;
            if rel % alignment != 0 {
                return Err(fail(format!("offset {rel} is not aligned to {alignment}")));
            }
            let offset =
                data_start.checked_add(rel).ok_or_else(|| fail("offset overflows".into()))?;
            match offset.checked_add(size) {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(fail(format!(
                        "data [{offset}, +{size}) extends past the end of the file ({file_len} bytes): truncated?"
                    )));
                }
            }
            tensors.push(TensorInfo { name, dims, ty, offset, size });
        }
        Ok(GgufFile { path: path.to_path_buf(), mmap, version, metadata, tensors })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shared memory map (weights borrow from it).
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (validated at open).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.offset..t.offset + t.size]
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required unsigned metadata value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .ok_or_else(|| TextError::format(&self.path, format!("missing metadata {key}")))?
            .as_u64()
            .ok_or_else(|| {
                TextError::format(&self.path, format!("metadata {key} is not an integer"))
            })
    }

    /// A required string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .ok_or_else(|| TextError::format(&self.path, format!("missing metadata {key}")))?
            .as_str()
            .ok_or_else(|| TextError::format(&self.path, format!("metadata {key} is not a string")))
    }
}

/// Writes GGUF v3 files (test models, conversions).
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata value. Integers are written as u32/i32 when they fit (as llama.cpp's
    /// converter does), floats as f32.
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor: `dims` innermost first, `data` already encoded in `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// Serializes to bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_str(&mut out, k);
            out.extend_from_slice(&value_type(v).to_le_bytes());
            write_value(&mut out, v);
        }
        let mut rel = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            write_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            out.extend_from_slice(&ty.gguf_id().to_le_bytes());
            out.extend_from_slice(&(rel as u64).to_le_bytes());
            offsets.push(rel);
            rel = (rel + data.len()).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        }
        let data_start = out.len().div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(data);
        }
        out
    }

    /// Writes the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut f = std::fs::File::create(path).map_err(|e| TextError::io(path, e))?;
        f.write_all(&self.to_bytes()).map_err(|e| TextError::io(path, e))
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U64(x) if u32::try_from(*x).is_ok() => 4,
        MetaValue::U64(_) => 10,
        MetaValue::I64(x) if i32::try_from(*x).is_ok() => 5,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
    }
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U64(x) => match u32::try_from(*x) {
            Ok(x) => out.extend_from_slice(&x.to_le_bytes()),
            Err(_) => out.extend_from_slice(&x.to_le_bytes()),
        },
        MetaValue::I64(x) => match i32::try_from(*x) {
            Ok(x) => out.extend_from_slice(&x.to_le_bytes()),
            Err(_) => out.extend_from_slice(&x.to_le_bytes()),
        },
        MetaValue::F64(x) => out.extend_from_slice(&(*x as f32).to_le_bytes()),
        MetaValue::Bool(b) => out.push(u8::from(*b)),
        MetaValue::String(s) => write_str(out, s),
        MetaValue::Array(items) => {
            // Arrays are homogeneous; the element type comes from the first item.
            let elem_ty = items.first().map_or(8, value_type);
            out.extend_from_slice(&elem_ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String("llama".into()));
        w.meta("llama.block_count", MetaValue::U64(2));
        w.meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::String("a".into()), MetaValue::String("b".into())]),
        );
        for ty in GgmlType::ALL {
            // The container does not read tensor bytes: any pattern of the right size will do.
            let n = ty.block_elems().max(32) * 2;
            let bytes = ty.row_bytes(n).unwrap_or_default() * 3;
            let data: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
            w.tensor(&format!("t.{}", ty.name()), &[n, 3], ty, data);
        }
        w
    }

    fn parse_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        let dir = tempfile::tempdir().map_err(|e| TextError::io("tempdir", e))?;
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, bytes).map_err(|e| TextError::io(&p, e))?;
        GgufFile::open(&p)
    }

    #[test]
    fn writes_and_reads_every_tensor_type() -> Result<()> {
        let w = sample();
        let f = parse_bytes(w.to_bytes())?;
        assert_eq!(f.get_str("general.architecture")?, "llama");
        assert_eq!(f.get_u64("llama.block_count")?, 2);
        assert_eq!(f.tensors.len(), GgmlType::ALL.len());
        for ((name, dims, ty, data), t) in w.tensors.iter().zip(&f.tensors) {
            assert_eq!(&t.name, name);
            assert_eq!(&t.dims, dims);
            assert_eq!(t.ty, *ty);
            assert_eq!(f.tensor_bytes(t), &data[..]);
        }
        Ok(())
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().to_bytes();
        let step = (bytes.len() / 200).max(1);
        for cut in (0..bytes.len()).step_by(step) {
            let r = parse_bytes(bytes[..cut].to_vec());
            assert!(r.is_err(), "truncated at {cut} of {} parsed", bytes.len());
        }
    }

    #[test]
    fn truncated_tensor_data_names_the_tensor() {
        let bytes = sample().to_bytes();
        let err = parse_bytes(bytes[..bytes.len() - 10].to_vec()).err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("tensor t.Q6_K") && msg.contains("truncated"), "{msg}");
    }

    #[test]
    fn hostile_counts_and_types_are_refused() {
        let mut bytes = sample().to_bytes();
        // Absurd tensor count.
        bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_bytes(bytes).is_err());
        // Unknown tensor type id: patch the first tensor's type field.
        let mut w = GgufWriter::new();
        w.tensor("x", &[32], GgmlType::F32, vec![0; 128]);
        let mut bytes = w.to_bytes();
        let ty_pos = 24 + 8 + 1 + 4 + 8;
        bytes[ty_pos..ty_pos + 4].copy_from_slice(&99u32.to_le_bytes());
        let msg = parse_bytes(bytes).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("tensor x") && msg.contains("99"), "{msg}");
    }
}
