//! Checkpoint weights: safetensors files, single (`model.safetensors`) or
//! sharded (`model.safetensors.index.json`), memory-mapped. Tensors are read
//! by name, their shape checked against what the model expects, and widened
//! to f32 (bf16/f16/f32 on disk; the CPU engine computes in f32).

use crate::{Error, Result};
use arcticd_kernels::Tensor;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The memory-mapped safetensors files of one checkpoint.
pub struct Checkpoint {
    files: Vec<(PathBuf, Mmap)>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
}

/// What a safetensors file that does not parse is, in words a user can act
/// on (the library's own reads `HeaderTooSmall`, `InvalidHeaderLength`).
pub fn unreadable_safetensors(path: &Path, e: &safetensors::SafeTensorError) -> String {
    format!(
        "{}: not a complete safetensors file (truncated, or another format): {e:?}",
        path.display()
    )
}

fn werr(msg: impl Into<String>) -> Error {
    Error::Weights(msg.into())
}

impl Checkpoint {
    /// Open the safetensors of a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| werr(format!("{}: {e}", index_path.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| werr(format!("{} has no weight_map", index_path.display())))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else if single.exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(werr(format!(
                "{} has neither model.safetensors nor model.safetensors.index.json",
                dir.display()
            )));
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for name in shard_names {
            if name.contains('/') || name.contains("..") {
                return Err(werr(format!(
                    "shard name {name:?} escapes the checkpoint directory"
                )));
            }
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the map is read-only; a checkpoint rewritten underneath a
            // running process is outside what we can guard against, as in every
            // mmap-based loader.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| werr(unreadable_safetensors(&path, &e)))?;
            for n in st.names() {
                index.insert(n.to_string(), files.len());
            }
            files.push((path, mmap));
        }
        Ok(Checkpoint { files, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Storage dtype of a tensor, for reporting.
    pub fn dtype_of(&self, name: &str) -> Option<Dtype> {
        let &i = self.index.get(name)?;
        let st = SafeTensors::deserialize(&self.files[i].1).ok()?;
        st.tensor(name).ok().map(|t| t.dtype())
    }

    /// Read `name` as f32 with exactly `shape`.
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| werr(format!("missing tensor {name}")))?;
        let (path, mmap) = &self.files[i];
        let st =
            SafeTensors::deserialize(mmap).map_err(|e| werr(unreadable_safetensors(path, &e)))?;
        let view = st
            .tensor(name)
            .map_err(|e| werr(format!("{name} in {}: {e}", path.display())))?;
        if view.shape() != shape {
            return Err(werr(format!(
                "tensor {name} has shape {:?}, the config implies {shape:?}",
                view.shape()
            )));
        }
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(werr(format!(
                    "tensor {name} has dtype {other:?}; supported: F32, BF16, F16"
                )))
            }
        };
        Ok(Tensor::from_f32(data, shape)?)
    }
}

/// On-disk dtype for [`save_safetensors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDType {
    F32,
    BF16,
}

impl SaveDType {
    /// `data` as this dtype's little-endian bytes.
    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            SaveDType::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SaveDType::BF16 => data
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }

    fn size(self) -> usize {
        match self {
            SaveDType::F32 => 4,
            SaveDType::BF16 => 2,
        }
    }
}

/// Whether `path` reads as a whole safetensors file (its header parses and
/// its data is all there), without reading the data: mapped, not loaded.
pub fn check_safetensors(path: &Path) -> Result<()> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only map, dropped before returning.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    SafeTensors::deserialize(&mmap).map_err(|e| werr(unreadable_safetensors(path, &e)))?;
    Ok(())
}

/// Write named f32 tensors to a safetensors file, converting to `dtype`.
/// Atomic: written to a temporary file beside `path`, then renamed, so a
/// crash never leaves a half-written checkpoint under the real name.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    dtype: SaveDType,
) -> Result<()> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            if shape.iter().product::<usize>() != data.len() {
                return Err(werr(format!(
                    "{name}: shape {shape:?} does not hold {} values",
                    data.len()
                )));
            }
            Ok((name.clone(), shape.clone(), dtype.encode(data)))
        })
        .collect::<Result<_>>()?;
    save_safetensors_encoded(path, &encoded, dtype)
}

/// [`save_safetensors`] of tensors already encoded as `dtype` bytes
/// ([`SaveDType::encode`]), streamed to the file: nothing beyond the
/// tensors themselves is held, so a checkpoint of many GB is written with
/// no second copy of it in memory. Atomic in the same way.
pub fn save_safetensors_encoded(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    dtype: SaveDType,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let st_dtype = match dtype {
        SaveDType::F32 => Dtype::F32,
        SaveDType::BF16 => Dtype::BF16,
    };
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            if s.iter().product::<usize>() * dtype.size() != b.len() {
                return Err(werr(format!(
                    "{n}: shape {s:?} does not hold {} bytes of {dtype:?}",
                    b.len()
                )));
            }
            TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| werr(format!("{n}: {e}")))
        })
        .collect::<Result<_>>()?;
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let tmp = temp_beside(path);
    let written = safetensors::serialize_to_file(views, &Some(meta), &tmp)
        .map_err(|e| match e {
            // The io error itself ("No space left on device"), not its
            // debug form.
            safetensors::SafeTensorError::IoError(e) => Error::io(&tmp, e),
            e => werr(format!("writing {}: {e}", tmp.display())),
        })
        .and_then(|()| {
            File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| Error::io(&tmp, e))
        });
    finish_temp(&tmp, path, written)
}

/// Renames the written temporary `tmp` to `path`, or, when the write
/// failed (a full disk), removes it, so a failure leaves nothing behind.
fn finish_temp(tmp: &Path, path: &Path, written: Result<()>) -> Result<()> {
    let done = written.and_then(|()| std::fs::rename(tmp, path).map_err(|e| Error::io(path, e)));
    if done.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    done
}

/// The temporary name beside `path` that [`write_atomic`] writes first.
fn temp_beside(path: &Path) -> PathBuf {
    path.with_extension(format!(
        "{}.tmp{}",
        path.extension().and_then(|e| e.to_str()).unwrap_or(""),
        std::process::id()
    ))
}

/// Write `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = temp_beside(path);
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(|e| Error::io(&tmp, e));
    finish_temp(&tmp, path, written)
}

/// Whether this process can make an entry in `folder`: a folder is made
/// there and removed again, so nothing is left.
pub fn can_write_in(folder: &Path) -> std::io::Result<()> {
    let probe = folder.join(format!(".arcticd-probe-{}", std::process::id()));
    std::fs::create_dir(&probe)?;
    std::fs::remove_dir(&probe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// A write that fails leaves no temporary file behind (a full disk
    /// stays full otherwise); here the rename fails, onto a folder.
    #[test]
    fn a_failed_atomic_write_leaves_nothing_behind() {
        let dir = std::env::temp_dir().join(format!("arcticd-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("metrics.jsonl");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), b"x").unwrap();
        assert!(write_atomic(&target, b"{}\n").is_err());
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(names, vec!["metrics.jsonl".to_string()]);
    }

    #[test]
    fn a_truncated_file_is_said_to_be_one() {
        let dir = std::env::temp_dir().join(format!("arcticd-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for bytes in [&b"\x05\x00"[..], &[200, 0, 0, 0, 0, 0, 0, 0, b'{']] {
            std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
            let e = Checkpoint::open(&dir).err().unwrap().to_string();
            assert!(e.contains("not a complete safetensors file"), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn reads_f32_bf16_f16_and_checks_shapes() {
        let dir = std::env::temp_dir().join(format!("arcticd-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vals = [1.5f32, -2.25, 0.125, 3.0];
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect();
        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        let f32b: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let i32b: Vec<u8> = [1i32, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
        let views = vec![
            (
                "a".to_string(),
                TensorView::new(Dtype::F16, vec![2, 2], &f16).unwrap(),
            ),
            (
                "b".to_string(),
                TensorView::new(Dtype::BF16, vec![4], &bf).unwrap(),
            ),
            (
                "c".to_string(),
                TensorView::new(Dtype::F32, vec![1, 4], &f32b).unwrap(),
            ),
            (
                "d".to_string(),
                TensorView::new(Dtype::I32, vec![2], &i32b).unwrap(),
            ),
        ];
        let bytes = safetensors::serialize(views, &None).unwrap();
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        for (name, shape) in [("a", vec![2, 2]), ("b", vec![4]), ("c", vec![1, 4])] {
            let t = ck.get_f32(name, &shape).unwrap();
            assert_eq!(t.as_f32().unwrap(), &vals, "{name}");
        }
        let e = ck.get_f32("a", &[4]).unwrap_err().to_string();
        assert!(e.contains("shape"), "{e}");
        assert!(ck
            .get_f32("d", &[2])
            .unwrap_err()
            .to_string()
            .contains("dtype"));
        assert!(ck
            .get_f32("zz", &[2])
            .unwrap_err()
            .to_string()
            .contains("missing"));

        // Round trip through the atomic writer, bf16 on disk.
        let data = vec![0.5f32, -1.0, 2.0];
        save_safetensors(
            &dir.join("model.safetensors"),
            &[("w".into(), vec![3], &data)],
            SaveDType::BF16,
        )
        .unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.get_f32("w", &[3]).unwrap().as_f32().unwrap(), &data[..]);
        assert_eq!(ck.dtype_of("w"), Some(Dtype::BF16));

        // Encoded tensors whose bytes disagree with their shape are refused
        // before anything is written, and the checkpoint stays as it was.
        let bad = [("w".to_string(), vec![4], SaveDType::BF16.encode(&data))];
        let e = save_safetensors_encoded(&dir.join("model.safetensors"), &bad, SaveDType::BF16)
            .unwrap_err();
        assert!(e.to_string().contains("does not hold 6 bytes"), "{e}");
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.get_f32("w", &[3]).unwrap().as_f32().unwrap(), &data[..]);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
