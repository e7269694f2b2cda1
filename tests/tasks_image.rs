//! Tasks whose environment is only a Docker `image` with the repository at
//! its `workdir` (SWE-bench style, no local `repo` folder): the repository
//! is exported once into the usual one-commit snapshot, `tasks validate`
//! and `tasks audit` accept the task, a scripted agent solves it through
//! the real harness with reward 1, the image's git history never reaches
//! the sandbox, and a missing image or workdir is a clear, named verdict.
//! The local backend's counterpart (a root file system folder as the
//! image) is checked on its snapshot, and on a workdir deep inside an
//! image folder.
//!
//! The test image is derived from the sandbox base image without a
//! registry (`docker create` + `docker cp` + `docker commit`) and removed
//! afterwards. A backend that is unavailable fails the test when `CI` is
//! set and is skipped loudly otherwise.

use anyhow::{ensure, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::docker::{self, DockerBackend};
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::validate::task_env;
use arcticd_sandbox::tasks::{toy, write_tasks, Task};
use arcticd_sandbox::{Backend, ExecRequest, Policy};
use arcticd_trainer::harness::format::render_call;
use arcticd_trainer::harness::{Harness, RolloutConfig, ScriptedPolicy, Termination};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// Words only the image's git history holds; never visible to the agent.
const SECRET: &str = "history-only-secret-4711";

mod common;
use common::{base_image, skip, TempDir};

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    run(Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .current_dir(dir))
}

/// The toy repository with a git history whose older commit holds a file
/// and a message the snapshot must not show.
fn repo_with_history(task: &Task, dir: &Path) -> Result<()> {
    let src = task.repo.as_ref().context("toy task without repo")?;
    run(Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dir))?;
    git(dir, &["init", "-q"])?;
    std::fs::write(dir.join("NOTES.txt"), format!("{SECRET}\n"))?;
    git(dir, &["add", "-A"])?;
    git(dir, &["commit", "-q", "-m", SECRET])?;
    std::fs::remove_file(dir.join("NOTES.txt"))?;
    git(dir, &["add", "-A"])?;
    git(dir, &["commit", "-q", "-m", "current"])?;
    git(dir, &["tag", "v-secret", "HEAD~1"])?;
    Ok(())
}

/// A derived image holding `repo` at /testbed, removed on drop.
struct TestImage(String);

impl TestImage {
    fn build(repo: &Path) -> Result<Self> {
        let tag = format!("arcticd-test-task-image:{}", std::process::id());
        let id = run(Command::new("docker").args([
            "create",
            "--network",
            "none",
            image::DEFAULT_TAG,
            "true",
        ]))?;
        let made = run(Command::new("docker")
            .arg("cp")
            .arg(format!("{}/.", repo.display()))
            .arg(format!("{id}:/testbed")))
        .and_then(|_| run(Command::new("docker").args(["commit", &id, &tag])));
        let _ = run(Command::new("docker").args(["rm", "-f", &id]));
        made?;
        Ok(TestImage(tag))
    }
}

impl Drop for TestImage {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", "-f", &self.0]).output();
    }
}

fn arcticd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(args)
        .output()
        .expect("running arcticd")
}

fn solving_script(t: &Task) -> Vec<String> {
    let s = &t.meta["toy"]["solution"];
    let g = |k: &str| s[k].as_str().unwrap_or_default().to_string();
    vec![
        render_call(
            "str_replace_based_edit_tool",
            &[
                ("command", "str_replace"),
                ("path", &g("path")),
                ("old_str", &g("old_str")),
                ("new_str", &g("new_str")),
            ],
        ),
        render_call("submit", &[]),
    ]
}

#[test]
fn image_only_task_runs_on_docker() -> Result<()> {
    match base_image() {
        Err(e) => {
            skip("docker", &e);
            return Ok(());
        }
        Ok(false) => {
            skip("docker", "cannot connect to the Docker daemon");
            return Ok(());
        }
        Ok(true) => {}
    }
    let dir = TempDir::new("docker")?;
    let cfg = toy::ToyConfig {
        count: 1,
        seed: 1,
        loose_share: 0.0,
        ..Default::default()
    };
    let tasks = toy::generate(&cfg, &dir.0.join("pool"))?;
    let repo = dir.0.join("repo");
    std::fs::create_dir_all(&repo)?;
    repo_with_history(&tasks[0], &repo)?;
    let img = TestImage::build(&repo)?;
    let mut task = tasks[0].clone();
    task.repo = None;
    task.image = Some(img.0.clone());
    let mut no_image = task.clone();
    no_image.instance_id = "no-such-image".into();
    no_image.image = Some("arcticd-no-such-image:0".into());
    let mut no_workdir = task.clone();
    no_workdir.instance_id = "no-such-workdir".into();
    no_workdir.workdir = "/srv/nothing-here".into();
    let file = dir.0.join("tasks.jsonl");
    write_tasks(&file, &[task.clone(), no_image, no_workdir])?;
    let f = file.display().to_string();

    // validate: the image task is valid; the others name what is missing,
    // and the command fails, saying how many are invalid.
    let out = arcticd(&["tasks", "validate", "--tasks", &f, "--backend", "docker"]);
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1) && err.contains("2 of 3 tasks are invalid"),
        "{err}"
    );
    let v: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    ensure!(v.len() == 3, "{v:?}");
    ensure!(v[0]["verdict"] == "valid", "{}", v[0]);
    for (x, what) in [
        (&v[1], "arcticd-no-such-image:0"),
        (&v[2], "/srv/nothing-here"),
    ] {
        let detail = x["detail"].as_str().unwrap_or_default();
        ensure!(
            x["verdict"] == "invalid"
                && x["reason"] == "environment"
                && detail.contains(x["instance_id"].as_str().unwrap_or("?"))
                && detail.contains(what),
            "{x}"
        );
    }

    // audit (a few mechanical wrong patches): the tight toy task is tight.
    let only = dir.0.join("one.jsonl");
    write_tasks(&only, std::slice::from_ref(&task))?;
    let r = arcticd(&[
        "tasks",
        "audit",
        "--tasks",
        &only.display().to_string(),
        "--backend",
        "docker",
        "--no-validate",
        "--max-variants",
        "3",
    ]);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let a: serde_json::Value = serde_json::from_slice(&r.stdout)?;
    ensure!(
        a["tight"] == 1 && a["results"][0]["infra_errors"] == 0,
        "{a}"
    );

    let model = dir.0.join("model");
    let m = arcticd(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        &model.display().to_string(),
    ]);
    ensure!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let backend = DockerBackend::new().await?;
        // The export is cached per (image, workdir).
        let s1 = backend.snapshot_from_image(&img.0, "/testbed").await?;
        let s2 = backend.snapshot_from_image(&img.0, "/testbed").await?;
        ensure!(Arc::ptr_eq(&s1, &s2), "the image was exported twice");
        ensure!(s1.path().join("README.md").exists() && !s1.path().join("NOTES.txt").exists());

        // Inside the sandbox: one commit, no tag, no trace of the secret.
        let (snap, image, policy) =
            task_env(&backend, &task, image::DEFAULT_TAG, &Policy::default()).await?;
        ensure!(Arc::ptr_eq(&snap, &s1));
        let sb = backend.start(&snap, &image, &policy).await?;
        let probe = sb
            .exec(ExecRequest::shell(format!(
                "git log --all --format=%s; echo tags:$(git tag); ls .git/objects/pack; \
                 grep -rl {SECRET} .git . 2>/dev/null | head -3; echo done"
            )))
            .await;
        let closed = sb.close().await;
        let probe = probe?;
        closed?;
        let out = probe.stdout.text();
        ensure!(
            out.lines().collect::<Vec<_>>() == ["snapshot", "tags:", "done"],
            "history leaked into the sandbox: {out}"
        );

        // A scripted agent solves the image task through the real harness.
        let tok = Arc::new(Tokenizer::from_dir(&model)?);
        let template = ChatTemplate::from_dir(&model)?.unwrap_or_else(ChatTemplate::qwen35);
        let h = Harness::new(tok.clone(), template, RolloutConfig::default())?;
        let policy = ScriptedPolicy::new(tok, solving_script(&task));
        let t = h.rollout(&policy, &backend, &task, 0).await;
        ensure!(
            t.termination == Termination::Submitted && t.reward == 1.0,
            "{:?} {}: {}",
            t.termination,
            t.reward,
            t.detail
        );
        ensure!(
            docker::list_own(backend.client()).await?.is_empty(),
            "containers left behind"
        );
        Ok(())
    })
}

#[test]
fn local_backend_snapshots_an_image_folder() -> Result<()> {
    if let Err(e) = base_image() {
        skip("local", &e);
        return Ok(());
    }
    let dir = TempDir::new("local")?;
    // A root file system folder (the local backend's image) whose /srv/app
    // is a repository with history.
    let rootfs = dir.0.join("rootfs");
    let app = rootfs.join("srv/app");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    std::fs::create_dir_all(&app)?;
    std::fs::write(app.join("main.py"), "print('hi')\n")?;
    git(&app, &["init", "-q"])?;
    git(&app, &["add", "-A"])?;
    git(&app, &["commit", "-q", "-m", SECRET])?;
    std::os::unix::fs::symlink("/etc", rootfs.join("etc-link"))?;
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let backend = match LocalBackend::new().await {
            Ok(b) => b,
            Err(e) => {
                skip("local", &e.to_string());
                return Ok(());
            }
        };
        let image = rootfs.display().to_string();
        let s = backend.snapshot_from_image(&image, "/srv/app").await?;
        ensure!(s.path().join("main.py").exists());
        let log = run(Command::new("git")
            .args(["log", "--all", "--format=%s"])
            .current_dir(s.path()))?;
        ensure!(log == "snapshot", "{log}");
        let again = backend.snapshot_from_image(&image, "/srv/app").await?;
        ensure!(Arc::ptr_eq(&s, &again));
        for (wd, want) in [
            ("/srv/missing", "/srv/missing"),
            ("/etc-link", "not a folder"),
            ("/srv/../..", "plain components"),
        ] {
            let e = match backend.snapshot_from_image(&image, wd).await {
                Ok(_) => anyhow::bail!("{wd} was accepted"),
                Err(e) => e.to_string(),
            };
            ensure!(e.contains(want), "{wd}: {e}");
        }
        let missing = backend
            .snapshot_from_image("arcticd-no-such-image:0", "/testbed")
            .await;
        ensure!(missing.is_err());

        // A workdir deep inside an image folder (`/usr/local` of the base
        // image): the copy is bound over the image's own folder, and the
        // rest of `/usr` (python) stays.
        let policy = Policy {
            workdir: "/usr/local".into(),
            ..Policy::default()
        };
        let sb = backend.start(&s, image::DEFAULT_TAG, &policy).await?;
        let r = sb
            .exec(ExecRequest::shell(
                "ls; touch new.py && python3 -c 'print(40 + 2)'",
            ))
            .await;
        let closed = sb.close().await;
        let r = r?;
        closed?;
        let out = r.stdout.text();
        ensure!(
            r.success() && out.lines().collect::<Vec<_>>() == ["main.py", "42"],
            "{out} {}",
            r.stderr.text()
        );
        Ok(())
    })
}
