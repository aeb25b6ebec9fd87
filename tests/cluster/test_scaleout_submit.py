"""`make submit` without a cluster: what is uploaded and that a too-large package fails
before upload with a message that says why, and the argument checks.

The upload contents are checked with Ray's own packaging code (`create_package`, the function
`ray job submit` zips the working dir with), given the runtime env `cluster.submit` builds.
"""

import json
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster import submit
from cluster.submit import MIB, SubmitError
from workloads.core.run import runner_args

SUITE = "kind: batch\nname: tiny\nmodel: tiny-llama\npolicies: [full]\nbatch_sizes: [1]\nprompt_tokens: [8]\nnew_tokens: [2]\n"


def _write(path: Path, size: int = 0, text: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        path.write_text(text)
    else:
        path.write_bytes(os.urandom(size))  # random bytes: incompressible, zip size ~ file size


@pytest.fixture
def repo(tmp_path):
    """A working dir shaped like this repo, with 2 MiB each of .git, results, .venv, .cache and
    dashboards/data, and a small `workloads/core/results.py` that must still travel."""
    root = tmp_path / "repo"
    _write(root / "workloads" / "suites" / "tiny.yaml", text=SUITE)
    _write(root / "workloads" / "core" / "results.py", text="# the results module, not the results folder\n")
    _write(root / "workloads" / "sweep.py", text="# sweep\n")
    _write(root / "cluster" / "placement.py", text="# placement\n")
    _write(root / ".gitignore", text=".venv/\nresults/\n.cache/\ndashboards/data/\n")
    for big in (
        ".git/objects/pack/pack-1.pack",
        "results/run-1/points.jsonl",
        ".venv/lib/torch/libtorch.so",
        ".cache/models/model.safetensors",
        "dashboards/data/prometheus/chunk",
    ):
        _write(root / big, 2 * MIB)
    _write(root / "workloads" / "__pycache__" / "sweep.cpython-311.pyc", 1024)
    return root


def _args(repo: Path, *extra: str):
    return submit.parse_args(["workloads/suites/tiny.yaml", "--working-dir", str(repo), *extra])


def _ray_zip_names(repo: Path, runtime_env: dict, tmp_path: Path) -> set[str]:
    from ray._private.runtime_env.packaging import create_package

    out = tmp_path / "pkg.zip"
    create_package(
        str(repo), out, include_gitignore=True, excludes=submit.ray_default_excludes() + runtime_env["excludes"]
    )
    with zipfile.ZipFile(out) as z:
        return {n for n in z.namelist() if not n.endswith("/")}


def test_git_results_venv_caches_are_not_uploaded(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo)
    plan = submit.build(_args(repo))
    names = _ray_zip_names(repo, plan["runtime_env"], tmp_path)
    assert names == {
        "workloads/suites/tiny.yaml",
        "workloads/core/results.py",
        "workloads/sweep.py",
        "cluster/placement.py",
        ".gitignore",
    }
    # the size check lists the same files Ray zips
    assert {p for p, _ in submit.package_files(repo, plan["excludes"])} == names


def test_excludes_hold_without_a_gitignore(repo, tmp_path, monkeypatch):
    """The runtime env's own excludes do the work even when .gitignore says nothing."""
    (repo / ".gitignore").unlink()
    monkeypatch.chdir(repo)
    plan = submit.build(_args(repo))
    names = _ray_zip_names(repo, plan["runtime_env"], tmp_path)
    assert not [n for n in names if n.startswith((".git/", "results/", ".venv/", ".cache/", "dashboards/data/"))]
    assert "workloads/core/results.py" in names
    report = submit.check_package(repo, plan["excludes"], 1 * MIB)
    assert report["files"] == 4 and report["bytes"] < 1024


def test_too_large_package_fails_before_upload_and_says_why(repo, monkeypatch, capsys):
    _write(repo / "data" / "corpus.bin", 3 * MIB)  # not excluded, incompressible
    monkeypatch.chdir(repo)
    ran = []
    monkeypatch.setattr(submit, "run_ray_cli", lambda cmd: ran.append(cmd) or 0)
    rc = submit.main(["workloads/suites/tiny.yaml", "--working-dir", str(repo), "--max-package-mib", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert ran == [], "ray job submit must not run"
    assert "package too large" in err
    assert "packs to 3.0 MiB" in err and "at most 2.0 MiB" in err  # the size and the limit
    assert "data/ (3.0 MiB, largest file data/corpus.bin 3.0 MiB)" in err  # the largest entry
    assert "nothing was uploaded" in err and "--exclude" in err and ".rayignore" in err


def test_size_check_matches_the_zip_ray_builds(repo, tmp_path, monkeypatch):
    """Ray stores files uncompressed; the check's size is the real zip's size."""
    from ray._private.runtime_env.packaging import create_package

    _write(repo / "data" / "zeros.txt", text="0" * MIB)
    monkeypatch.chdir(repo)
    plan = submit.build(_args(repo))
    out = tmp_path / "pkg.zip"
    create_package(str(repo), out, include_gitignore=True, excludes=submit.ray_default_excludes() + plan["excludes"])
    report = submit.check_package(repo, plan["excludes"], 100 * MIB)
    assert abs(report["bytes"] - out.stat().st_size) <= 64 * report["files"], (report, out.stat().st_size)


def test_exclude_flag_adds_a_pattern(repo, monkeypatch):
    _write(repo / "data" / "corpus.bin", 3 * MIB)
    monkeypatch.chdir(repo)
    plan = submit.build(_args(repo, "--exclude", "/data/"))
    assert "/data/" in plan["excludes"]
    assert submit.check_package(repo, plan["excludes"], 2 * MIB)["bytes"] < 1024


def test_command_passes_suite_results_run_id_and_runtime_env(repo, monkeypatch):
    monkeypatch.chdir(repo)
    for name in submit.PASS_THROUGH_ENV:
        monkeypatch.delenv(name, raising=False)
    plan = submit.build(
        _args(
            repo,
            "--run-id",
            "r1",
            "--results-dir",
            "/mnt/shared/results",
            "--address",
            "10.0.0.5:8265",
            "--job-python",
            "python3",
            "--",
            "--replicas",
            "4",
        )
    )
    cmd = plan["cmd"]
    assert cmd[1:4] == ["job", "submit", "--address"] and cmd[4] == "http://10.0.0.5:8265"
    assert cmd[cmd.index("--submission-id") + 1].startswith("sweep-r1-")
    assert json.loads(cmd[cmd.index("--metadata-json") + 1]) == {"scissorhands_run_id": "r1"}
    env = json.loads(cmd[cmd.index("--runtime-env-json") + 1])
    assert "SCISSORHANDS_CACHE_DIR" not in env["env_vars"]  # a remote cluster's paths are its own
    assert env["working_dir"] == str(repo)
    assert env["env_vars"]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"  # remote: Ray's multi-node behaviour
    assert "SCISSORHANDS_GIT_COMMIT" in env["env_vars"]
    assert cmd[cmd.index("--") + 1 :] == [
        "python3",
        "-m",
        "workloads.sweep",
        "workloads/suites/tiny.yaml",
        "--results-dir",
        "/mnt/shared/results",
        "--run-id",
        "r1",
        "--replicas",
        "4",
    ]


def test_loopback_defaults_results_to_the_repo_and_this_python(repo, monkeypatch):
    import sys

    monkeypatch.chdir(repo)
    plan = submit.build(_args(repo, "--run-id", "r2"))
    assert plan["results_dir"] == repo / "results"
    assert plan["entrypoint"][0] == sys.executable
    assert plan["address"] == "http://127.0.0.1:8265"
    env = plan["runtime_env"]["env_vars"]
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # loopback head
    from scissorhands.models import embedded_cache_dir

    # same machine: the job reuses the converted model and the token cache (.cache is not uploaded)
    assert env["SCISSORHANDS_CACHE_DIR"] == str(embedded_cache_dir())
    assert env["SCISSORHANDS_TOKEN_CACHE_DIR"] == str(repo / ".cache" / "tokens")


def test_set_overrides_reach_the_jobs_sweep_as_make_sweep_takes_them(repo, monkeypatch):
    monkeypatch.chdir(repo)
    plan = submit.build(
        _args(repo, "--run-id", "r3", "--set", "scheduler=mixed", "--set", "slo.ttft_s=0.5", "--", "--replicas", "2")
    )
    assert plan["entrypoint"][-8:] == [
        "--run-id",
        "r3",
        "--set",
        "scheduler=mixed",
        "--set",
        "slo.ttft_s=0.5",
        "--replicas",
        "2",
    ]
    # the sweep's own parser reads them as `make sweep ARGS="--set ..."` gives them
    sweep = runner_args(plan["entrypoint"][3:], "sweep", "doc", "suite")
    assert sweep.set == ["scheduler=mixed", "slo.ttft_s=0.5"] and sweep.replicas == 2


@pytest.mark.parametrize(
    "item, needle",
    [("scheduler", "--set: expected KEY=VALUE"), ("slo..ttft_s=1", "--set: expected KEY=VALUE"), ("a=[1", "--set a:")],
)
def test_a_malformed_set_override_exits_2_before_upload_naming_set(repo, monkeypatch, capsys, item, needle):
    monkeypatch.chdir(repo)
    monkeypatch.setattr(submit, "run_ray_cli", lambda cmd: pytest.fail("submitted"))
    assert submit.main(["workloads/suites/tiny.yaml", "--working-dir", str(repo), "--set", item]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--address", "10.0.0.5:8265"), "--results-dir: required for a remote cluster"),
        (("--address", "10.0.0.5:8265", "--results-dir", "results"), "is relative; for a remote cluster"),
        (("--address", "ray://10.0.0.5:10001"), "is a Ray client address"),
    ],
)
def test_argument_errors_name_the_flag(repo, monkeypatch, extra, needle):
    monkeypatch.chdir(repo)
    with pytest.raises(SubmitError, match=needle.replace("(", r"\(")):
        submit.build(_args(repo, *extra))


def test_suite_outside_the_working_dir_is_refused(repo, tmp_path, monkeypatch):
    outside = tmp_path / "other.yaml"
    outside.write_text(SUITE)
    monkeypatch.chdir(repo)
    with pytest.raises(SubmitError, match="outside the working dir"):
        submit.build(submit.parse_args([str(outside), "--working-dir", str(repo)]))
    with pytest.raises(SubmitError, match="suite: file not found"):
        submit.build(submit.parse_args(["nope.yaml", "--working-dir", str(repo)]))


def test_auth_mode_token_when_a_token_exists(tmp_path):
    token = tmp_path / "auth_token"
    assert "RAY_AUTH_MODE" not in submit.auth_env({"RAY_AUTH_TOKEN_PATH": str(token)})
    token.write_text("t")
    assert submit.auth_env({"RAY_AUTH_TOKEN_PATH": str(token)})["RAY_AUTH_MODE"] == "token"
    assert (
        submit.auth_env({"RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": "disabled"})["RAY_AUTH_MODE"] == "disabled"
    )


class FakeJobServer:
    """The job server's side of `ray job submit`: jobs by submission id, each with its metadata and status."""

    def __init__(self):
        self.jobs: dict = {}

    def submit(self, cmd):  # what `run_ray_cli` runs
        sid = cmd[cmd.index("--submission-id") + 1]
        meta = json.loads(cmd[cmd.index("--metadata-json") + 1])
        self.jobs[sid] = {"submission_id": sid, "metadata": meta, "status": "RUNNING", "log": f"log of {sid}\n"}
        return 0

    def client(self, address):
        server = self

        class Client:
            def list_jobs(self):
                return [SimpleNamespace(**j) for j in server.jobs.values()]

            def get_job_info(self, sid):
                return SimpleNamespace(**server.jobs[sid], message=None)

            def get_job_logs(self, sid):
                return server.jobs[sid]["log"]

        return Client()


def test_a_run_id_submitted_again_is_refused_while_its_job_runs_and_never_overwrites_its_files(
    repo, monkeypatch, capsys
):
    import ray.job_submission

    monkeypatch.chdir(repo)
    server = FakeJobServer()
    monkeypatch.setattr(submit, "run_ray_cli", server.submit)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", server.client)
    run_dir = repo / "results" / "again"
    run_dir.mkdir(parents=True)
    argv = [
        "workloads/suites/tiny.yaml",
        "--working-dir",
        str(repo),
        "--run-id",
        "again",
        "--address",
        "127.0.0.1:8265",
    ]
    assert submit.main([*argv, "--no-wait"]) == 0
    (first,) = server.jobs
    assert first.startswith("sweep-again-")
    # the same suite and run id while the first job still runs: refused before submitting, both named
    assert submit.main([*argv, "--no-wait"]) == 2
    err = capsys.readouterr().err
    assert "--run-id again" in err and first in err and "RUNNING" in err
    assert list(server.jobs) == [first]
    # the first job ends; its files are saved; a resubmission is a job of its own with files of its own
    server.jobs[first]["status"] = "FAILED"
    submit.save_job_record(
        {
            "results_dir": repo / "results",
            "run_id": "again",
            "submission_id": first,
            "address": "a",
            "entrypoint": ["x"],
        },
        "FAILED",
        None,
        server.jobs[first]["log"],
    )
    monkeypatch.setattr(
        submit,
        "run_ray_cli",
        lambda cmd: (server.submit(cmd), server.jobs[cmd[cmd.index("--submission-id") + 1]].update(status="SUCCEEDED"))[
            0
        ],
    )
    assert submit.main(argv) == 0
    second = [s for s in server.jobs if s != first][0]
    assert f"job {second} SUCCEEDED" in capsys.readouterr().err
    assert json.loads((run_dir / "job.json").read_text())["submission_id"] == first
    assert (run_dir / "job.log").read_text() == f"log of {first}\n"
    assert json.loads((run_dir / f"job-{second}.json").read_text())["status"] == "SUCCEEDED"
    assert (run_dir / f"job-{second}.log").read_text() == f"log of {second}\n"


def test_each_submission_of_one_run_id_gets_its_own_job_id(repo, monkeypatch):
    monkeypatch.chdir(repo)
    ids = {submit.build(_args(repo, "--run-id", "r1"))["submission_id"] for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("sweep-r1-") for i in ids)
