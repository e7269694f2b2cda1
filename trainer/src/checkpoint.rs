//! Checkpoints in Hugging Face layout, so transformers (and `arcticd score`)
//! load them: `config.json` (the source checkpoint's, as read), f32
//! `model.safetensors` under the parameters' Hugging Face names, the source's
//! tokenizer and generation files; beside them, for resume, the AdamW moments
//! (`optimizer.safetensors`, `exp_avg.NAME` / `exp_avg_sq.NAME`) and
//! `trainer_state.json` (step, optimizer config). The master weights are the
//! f32 model weights themselves.
//!
//! Atomic: everything is written into a fresh sibling directory, which then
//! replaces the target by rename (the previous checkpoint, if any, is moved
//! aside first and removed last). A crash leaves either the old or the new
//! checkpoint complete under the target name, or (between the two renames)
//! the old one under `NAME.old`; never a half-written file under the real
//! name.
//!
//! Not for: the wrapper's vision tower or MTP weights (a `qwen3_5` wrapper
//! source is saved with its text weights only; transformers initializes the
//! rest).

use crate::optim::{AdamW, AdamWConfig};
use crate::{Error, Result};
use arcticd_engine::weights::{save_safetensors, SaveDType};
use arcticd_engine::Qwen3_5;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Files copied verbatim from the source checkpoint when present.
const COPIED_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
];

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub optimizer: AdamWConfig,
}

fn cerr(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

fn tmp_sibling(out: &Path, tag: &str) -> Result<PathBuf> {
    let name = out.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        cerr(format!(
            "{}: not a folder name a checkpoint can take (name a new folder)",
            out.display()
        ))
    })?;
    Ok(out.with_file_name(format!(".{name}.{tag}{}", std::process::id())))
}

/// Whether `dir` may be replaced by a checkpoint: absent, an empty folder,
/// or a checkpoint (its `config.json` and `model.safetensors`). Anything
/// else is the user's, and a checkpoint written there would remove it.
fn replaceable(dir: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    if !meta.is_dir() {
        return Err(cerr(format!(
            "{} exists and is not a folder; a checkpoint is a folder",
            dir.display()
        )));
    }
    let empty = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .next()
        .is_none();
    if empty || (dir.join("config.json").is_file() && dir.join("model.safetensors").is_file()) {
        return Ok(());
    }
    Err(cerr(format!(
        "{} holds files that are not a checkpoint; writing one there would \
         remove them: choose a new or empty folder",
        dir.display()
    )))
}

/// Checks, before any work, that a checkpoint can be written to `out`:
/// it names a folder that is absent, empty or a checkpoint (replaced by
/// the new one), and its nearest existing ancestor can be written (a
/// folder is created there and removed again; nothing is left). A
/// training run calls it first, so that a wrong `--out` fails in a second
/// rather than after the last step.
pub fn check_checkpoint_out(out: &Path) -> Result<()> {
    replaceable(out)?;
    // A folder name a checkpoint can take.
    tmp_sibling(out, "probe")?;
    let mut at = out.parent().unwrap_or(Path::new(""));
    while !at.as_os_str().is_empty() && !at.exists() {
        at = at.parent().unwrap_or(Path::new(""));
    }
    let at = if at.as_os_str().is_empty() {
        Path::new(".")
    } else {
        at
    };
    arcticd_engine::weights::can_write_in(at).map_err(|e| {
        cerr(format!(
            "cannot write a checkpoint to {}: {e}",
            out.display()
        ))
    })
}

/// Save `model` (and optionally the optimizer) to `out`; config and
/// tokenizer files come from `source` (the directory the model was loaded
/// from).
pub fn save_checkpoint(
    out: &Path,
    model: &Qwen3_5,
    source: &Path,
    optimizer: Option<&AdamW>,
) -> Result<()> {
    save_checkpoint_with(out, model, source, optimizer, &[])
}

/// [`save_checkpoint`] with extra files (name, bytes) written into the same
/// directory before it appears, so they land atomically with the weights
/// (the RL loop's run state).
pub fn save_checkpoint_with(
    out: &Path,
    model: &Qwen3_5,
    source: &Path,
    optimizer: Option<&AdamW>,
    extra: &[(&str, Vec<u8>)],
) -> Result<()> {
    replaceable(out)?;
    let tmp = tmp_sibling(out, "tmp")?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let config = source.join("config.json");
    let text = match std::fs::read(&config) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            serde_json::to_vec_pretty(&model.config.raw_text_config)
                .map_err(|e| cerr(e.to_string()))?
        }
        Err(e) => return Err(Error::io(&config, e)),
    };
    arcticd_engine::weights::write_atomic(&tmp.join("config.json"), &text)?;
    for f in COPIED_FILES {
        let src = source.join(f);
        if src.is_file() {
            let bytes = std::fs::read(&src).map_err(|e| Error::io(&src, e))?;
            arcticd_engine::weights::write_atomic(&tmp.join(f), &bytes)?;
        }
    }
    let params = model.named_params();
    let mut tensors = Vec::with_capacity(params.len());
    for (name, p) in &params {
        tensors.push((name.clone(), p.shape().to_vec(), p.as_f32()?));
    }
    save_safetensors(&tmp.join("model.safetensors"), &tensors, SaveDType::F32)?;
    if let Some(opt) = optimizer {
        let mut moments = Vec::with_capacity(2 * opt.names.len());
        for (i, name) in opt.names.iter().enumerate() {
            let shape = opt.shapes[i].clone();
            moments.push((
                format!("exp_avg.{name}"),
                shape.clone(),
                &opt.exp_avg[i][..],
            ));
            moments.push((format!("exp_avg_sq.{name}"), shape, &opt.exp_avg_sq[i][..]));
        }
        save_safetensors(&tmp.join("optimizer.safetensors"), &moments, SaveDType::F32)?;
        let state = TrainerState {
            step: opt.step,
            optimizer: opt.config,
        };
        let json = serde_json::to_vec_pretty(&state).map_err(|e| cerr(e.to_string()))?;
        arcticd_engine::weights::write_atomic(&tmp.join("trainer_state.json"), &json)?;
    }
    for (name, bytes) in extra {
        arcticd_engine::weights::write_atomic(&tmp.join(name), bytes)?;
    }
    // Swap the directories.
    let old = tmp_sibling(out, "old")?;
    if out.exists() {
        std::fs::rename(out, &old).map_err(|e| Error::io(out, e))?;
    }
    std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Restore AdamW moments and step saved by [`save_checkpoint`] into an
/// optimizer built from the checkpoint's model. Its hyper-parameters stay
/// `opt`'s (the caller's recipe): the checkpoint records the ones it was
/// written with, and a replay or a resume with a changed `eps` or `beta2`
/// must step with the changed ones.
pub fn load_optimizer(dir: &Path, opt: &mut AdamW) -> Result<()> {
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainerState = serde_json::from_slice(&text)
        .map_err(|e| cerr(format!("{}: {e}", state_path.display())))?;
    let path = dir.join("optimizer.safetensors");
    let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| cerr(arcticd_engine::weights::unreadable_safetensors(&path, &e)))?;
    for (i, name) in opt.names.iter().enumerate() {
        for (key, dst) in [
            (format!("exp_avg.{name}"), &mut opt.exp_avg[i]),
            (format!("exp_avg_sq.{name}"), &mut opt.exp_avg_sq[i]),
        ] {
            let view = st
                .tensor(&key)
                .map_err(|e| cerr(format!("{}: {key}: {e}", path.display())))?;
            if view.dtype() != safetensors::Dtype::F32 || view.data().len() != dst.len() * 4 {
                return Err(cerr(format!("{key}: expected {} f32 values", dst.len())));
            }
            for (d, b) in dst.iter_mut().zip(view.data().chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
    opt.step = state.step;
    Ok(())
}

/// `(name, shape, values)` of one tensor.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Every tensor of one safetensors file widened to f32 (F32/BF16/F16), sorted
/// by name: for comparing checkpoints and reading reference fixtures.
pub fn read_safetensors_f32(path: &Path) -> Result<Vec<NamedTensor>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| cerr(arcticd_engine::weights::unreadable_safetensors(path, &e)))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let b = view.data();
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => b
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect(),
            safetensors::Dtype::BF16 => b
                .chunks_exact(2)
                .map(|x| f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16))
                .collect(),
            other => {
                return Err(cerr(format!(
                    "{name} in {}: dtype {other:?} not read here",
                    path.display()
                )))
            }
        };
        out.push((name, view.shape().to_vec(), data));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_replaces_only_an_absent_empty_or_checkpoint_folder() {
        let root = tempfile::tempdir().unwrap();
        let at = |name: &str| root.path().join(name);
        // Absent, empty, or a checkpoint: accepted.
        check_checkpoint_out(&at("new/deeper")).unwrap();
        std::fs::create_dir(at("empty")).unwrap();
        check_checkpoint_out(&at("empty")).unwrap();
        std::fs::create_dir(at("ckpt")).unwrap();
        std::fs::write(at("ckpt/config.json"), "{}").unwrap();
        std::fs::write(at("ckpt/model.safetensors"), "").unwrap();
        check_checkpoint_out(&at("ckpt")).unwrap();
        // A folder of the user's files, or a file: refused, and untouched.
        std::fs::create_dir_all(at("mine/sub")).unwrap();
        std::fs::write(at("mine/notes.txt"), "keep").unwrap();
        let e = check_checkpoint_out(&at("mine")).unwrap_err().to_string();
        assert!(e.contains("not a checkpoint"), "{e}");
        std::fs::write(at("file.txt"), "keep").unwrap();
        let e = check_checkpoint_out(&at("file.txt"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a folder"), "{e}");
        // No folder name, or a parent that cannot hold a folder.
        assert!(check_checkpoint_out(Path::new(".")).is_err());
        let e = check_checkpoint_out(&at("file.txt/x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("Not a directory"), "{e}");
        // Nothing was left behind or removed.
        let mut names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["ckpt", "empty", "file.txt", "mine"]);
        assert_eq!(
            std::fs::read_to_string(at("mine/notes.txt")).unwrap(),
            "keep"
        );
        assert!(at("mine/sub").is_dir());
    }

    #[test]
    fn saving_over_a_folder_of_other_files_is_refused_and_keeps_them() {
        let root = tempfile::tempdir().unwrap();
        let mine = root.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        std::fs::write(mine.join("notes.txt"), "keep").unwrap();
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/grads/mqa_tied");
        let model = Qwen3_5::load(&source).unwrap();
        let e = save_checkpoint(&mine, &model, &source, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a checkpoint"), "{e}");
        assert_eq!(
            std::fs::read_to_string(mine.join("notes.txt")).unwrap(),
            "keep"
        );
        // A checkpoint folder is replaced.
        let ckpt = root.path().join("ckpt");
        save_checkpoint(&ckpt, &model, &source, None).unwrap();
        save_checkpoint(&ckpt, &model, &source, None).unwrap();
        assert!(ckpt.join("model.safetensors").is_file());
    }
}
