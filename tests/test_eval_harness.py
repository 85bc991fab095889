"""lm-evaluation-harness on tieflax runs (tieflax.eval.harness, ``tieflax evaluate``), offline.

The tests write three small tasks (multiple choice, generate_until with exact_match, rolling
loglikelihood) over local JSON files, train a tiny run, and check that ``tieflax evaluate`` on the run and
lm-eval's own ``hf`` backend on its ``tieflax convert --to-hf`` export agree sample by sample:
log-likelihoods within 1e-4 (fp32), the same is_greedy, the same greedy generations. Random-init runs of
other families (gemma2 soft-caps and sliding windows, gpt2 learned positions; tied and untied) get the same
check, their large init making generations varied.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # before lm-eval imports datasets

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("lm_eval", reason="the test extra (lm-eval) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="lm-eval's hf backend needs accelerate (the hf extra)")

import flax.linen as nn  # noqa: E402

from task_support import TASKS, write_tasks  # noqa: E402
from tieflax.run.identity import load_workdir_config  # noqa: E402
from tieflax.run.checkpoints import save_initial_params  # noqa: E402
from tieflax.cli import main  # noqa: E402
from tieflax.config import default_model_config, model_config  # noqa: E402
from tieflax.eval.tasks import run_tasks, task_manager  # noqa: E402
from tieflax.model import TransformerLM  # noqa: E402

# lm-eval scores in this process: without its torch environment report (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("lm_eval_without_env_report")

SEQ = 64
TRAIN = ["--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512", "--config.model.d_model=32",
         "--config.model.n_layers=2", "--config.model.d_ff=64", f"--config.model.max_seq_len={SEQ}",
         f"--config.train.seq_len={SEQ}", "--config.train.num_steps=20", "--config.train.global_batch_size=8",
         "--config.train.eval_every=1000", "--config.train.eval_batches=1"]


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    """torch (lm-eval's ``hf`` backend, the exports loaded by transformers) on one thread: its idle workers
    spin on a loaded machine (tests/train_support.py's torch_one_thread)."""
    from train_support import torch_one_thread

    with torch_one_thread():
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tiny.py")
    run = str(root / "run")
    assert main(["train", "--config", tiny, "--workdir", run, *TRAIN]) == 0
    return {"root": root, "tasks": write_tasks(root / "tasks"), "run": run}


def random_run(world, name: str, **model) -> str:
    """A workdir holding random large-init params of another model (the trained run's tokenizer and data)."""
    run = str(world["root"] / name)
    config = load_workdir_config(world["run"])
    config.model = default_model_config(**{**dict(vocab_size=512, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                                                  max_seq_len=SEQ, init_std=0.3, embed_init_std=1.0), **model})
    config.mesh.data = 1   # one device: compiles faster (the trained run covers the 8-device mesh)
    params = TransformerLM(model_config(config)).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    save_initial_params(run, config, nn.unbox(params))
    shutil.copy(os.path.join(world["run"], "tokenizer.json"), os.path.join(run, "tokenizer.json"))
    return run


def close(a: float, b: float) -> bool:
    """Within 1e-4, or within fp32 rounding of a long sum: a random-init model's whole-text log-likelihood
    is about -2,000 (one fp32 ulp: 1.2e-4), a sum of per-token log-probabilities that XLA and torch each
    round in their own order (seen: -1993.7493 vs -1993.7490 on one machine and not on another). 1e-6 of
    the total is a few ulps; an error of tieflax's (a token shifted or dropped, a softcap or norm left out)
    moves it by whole units."""
    return abs(a - b) <= 1e-4 + 1e-6 * abs(b)


def hf_samples(world, run: str, tasks=TASKS) -> dict:
    """lm-eval's ``hf`` backend on ``run``'s export (made here, used as exported): {task: samples}."""
    export = run + "_hf"
    assert main(["convert", "--to-hf", "--workdir", run, "--out", export]) == 0
    theirs = run_tasks("hf", tasks, task_manager(tasks, world["tasks"]), batch_size=8, log_samples=True,
                       model_args={"pretrained": export, "max_length": SEQ, "dtype": "float32", "device": "cpu"})
    return theirs["samples"]


def assert_same_samples(ours: dict, theirs: dict) -> None:
    """Per sample: the same prompt, log-likelihoods within 1e-4, the same is_greedy and generations.
    Values may be strings (as lm-eval's samples files hold them) or numbers (in memory)."""
    for task in TASKS:
        mine = sorted(ours[task], key=lambda s: s["doc_id"])
        hf = sorted(theirs[task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in hf] and mine
        for a, b in zip(mine, hf):
            assert a["doc_hash"] == b["doc_hash"] and a["prompt_hash"] == b["prompt_hash"]
            for ra, rb in zip(a["resps"], b["resps"]):
                ra, rb = ra[0], rb[0]
                if task == "tf_gen":
                    assert ra == rb, (a["doc_id"], ra, rb)
                elif task == "tf_mc":
                    assert close(float(ra[0]), rb[0]) and str(ra[1]) == str(rb[1]), (a["doc_id"], ra, rb)
                else:
                    assert close(float(ra), rb), (a["doc_id"], ra, rb)


def test_evaluate_on_a_trained_run_agrees_with_the_hf_backend_on_its_export(world, capsys):
    """``tieflax evaluate --output --log-samples`` writes lm-eval's own files; their samples match ``hf``."""
    out = str(world["root"] / "out")
    assert main(["evaluate", "--workdir", world["run"], "--tasks", ",".join(TASKS), "--include-path",
                 world["tasks"], "--output", out, "--log-samples"]) == 0
    assert "tf_mc" in capsys.readouterr().out
    (results,) = glob.glob(os.path.join(out, "*", "results_*.json"))
    assert set(json.load(open(results))["results"]) == set(TASKS)
    ours = {}
    for task in TASKS:
        (samples,) = glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl"))
        ours[task] = [json.loads(line) for line in open(samples)]
        assert {"doc_id", "resps", "filtered_resps", "doc_hash", "prompt_hash"} <= set(ours[task][0])
    assert_same_samples(ours, hf_samples(world, world["run"]))
    # The export as exported: transformers generates and stops on its own EOS.
    export = world["run"] + "_hf"
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token_id == tok.eos_token_id == tok.pad_token_id
    assert transformers.GenerationConfig.from_pretrained(export).eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("family,model", [
    ("gemma2_untied", dict(family="gemma2", mlp="geglu", norm_unit_offset=True, sandwich_norms=True,
                           attn_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=16.0, sliding_window=8,
                           sliding_window_every=2, scale_input_embedding=True, n_kv_heads=2, head_dim=16,
                           embed_init_std=0.03, tie_embeddings=False)),
    ("gpt2_tied", dict(family="gpt2", norm="layernorm", mlp="gelu", position="learned", qkv_bias=True,
                       attn_out_bias=True, mlp_bias=True, tie_embeddings=True)),
    ("llama_untied", dict(family="llama", n_kv_heads=2, tie_embeddings=False)),
])
def test_other_families_agree_with_the_hf_backend(world, family, model):
    run = random_run(world, family, **model)
    ours = run_tasks("tieflax", TASKS, task_manager(TASKS, world["tasks"]), model_args={"pretrained": run},
                     batch_size=8, log_samples=True)["samples"]
    assert_same_samples(ours, hf_samples(world, run))
    generations = [s["resps"][0][0] for s in ours["tf_gen"]]
    assert len(set(generations)) > 1, generations   # varied text, so equal generations mean something


def _fails(capsys, argv, *needles):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err


def test_bad_input_is_one_line(world, capsys, tmp_path):
    run, tasks = world["run"], world["tasks"]
    _fails(capsys, ["evaluate", "--workdir", run, "--tasks", "no_such_task", "--include-path", tasks],
           "unknown lm-eval task 'no_such_task'")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    shutil.copy(os.path.join(run, "config.json"), empty)
    _fails(capsys, ["evaluate", "--workdir", empty, "--tasks", "tf_mc", "--include-path", tasks],
           "no checkpoint", "train first")
    _fails(capsys, ["evaluate", "--workdir", run, "--tasks", "tf_mc", "--include-path", tasks, "--batch-size", "3"],
           "--batch-size 3 does not divide", "multiple of 8")
    _fails(capsys, ["sample", "--workdir", run, "--prompt", "In the beginning " * 40], "exceeds the model's context")


def test_sample_continues_a_prompt(world, capsys):
    assert main(["sample", "--workdir", world["run"], "--prompt", "In the beginning", "--max-new-tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    assert main(["sample", "--workdir", world["run"], "--prompt", "In the beginning", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == greedy and greedy.strip()


def test_every_flag_of_evaluate_and_sample_is_checked_before_work(world, capsys, tmp_path):
    """`--limit 0` / `-1` were 32- and 35-line tracebacks, `--batch-size 0` / `-4` silently used, an
    `--output` that is a file got no results (exit 0), `sample --temperature nan` printed an empty line
    (exit 0). Each is one line before the checkpoint loads; nothing is written."""
    run, tasks = world["run"], world["tasks"]
    a_file = tmp_path / "results.json"
    a_file.write_text("mine")
    base = ["evaluate", "--workdir", run, "--tasks", "tf_mc", "--include-path", tasks]
    for extra, needle in ((["--limit", "0"], "--limit 0: give the items per task"),
                          (["--limit", "-1"], "--limit -1: give the items per task"),
                          (["--limit", "nan"], "--limit nan"),
                          (["--limit", "2.5"], "--limit 2.5: above 1 it counts items, a whole number"),
                          (["--batch-size", "0"], "--batch-size 0: use 1 or more"),
                          (["--batch-size", "-4"], "--batch-size -4: use 1 or more"),
                          (["--token-budget", "0"], "--token-budget 0: use 1 or more"),
                          (["--num-fewshot", "-1"], "--num-fewshot -1: use 0 or more"),
                          (["--step", "-1"], "--step -1: use 0 or more"),
                          (["--log-samples"], "--log-samples keeps lm-eval's per-sample records in --output"),
                          (["--output", str(a_file)], f"--output {a_file} is a file"),
                          (["--output", str(a_file / "sub")], f"--output {a_file / 'sub'} cannot be a folder: "
                                                              f"{a_file} is a file")):
        _fails(capsys, base + extra, needle)
    for extra, needle in ((["--temperature", "nan"], "--temperature nan: use a finite number >= 0"),
                          (["--temperature", "inf"], "--temperature inf"),
                          (["--temperature", "-0.5"], "--temperature -0.5"),
                          (["--max-new-tokens", "0"], "--max-new-tokens 0: use 1 or more"),
                          (["--step", "-2"], "--step -2")):
        _fails(capsys, ["sample", "--workdir", run, "--prompt", "In the beginning", *extra], needle)
    assert a_file.read_text() == "mine" and os.listdir(tmp_path) == ["results.json"]


def test_a_task_file_that_does_not_parse_or_render_is_one_line_naming_file_and_line(world, capsys, tmp_path):
    """A YAML syntax error was reported as "unknown task, not in lm-eval's registry"; a template with an
    undefined variable was a 48-line jinja traceback. Both name the file, the line and the error."""
    run = world["run"]
    bad = tmp_path / "bad"
    shutil.copytree(world["tasks"], bad)
    text = (bad / "tf_mc.yaml").read_text()
    (bad / "tf_mc.yaml").write_text(text.replace('doc_to_choice: "{{choices}}"', 'doc_to_choice: [{{choices}}'))
    line = 1 + text.splitlines().index('doc_to_choice: "{{choices}}"')
    _fails(capsys, ["evaluate", "--workdir", run, "--tasks", "tf_mc", "--include-path", str(bad)],
           f"task file {bad / 'tf_mc.yaml'}, line {line + 1}", "not valid YAML")
    undefined = tmp_path / "undefined"
    shutil.copytree(world["tasks"], undefined)
    (undefined / "tf_mc.yaml").write_text(text.replace('"{{question}}"', '"{{questio}}"'))
    line = 1 + text.splitlines().index('doc_to_text: "{{question}}"')
    assert main(["evaluate", "--workdir", run, "--tasks", "tf_mc", "--include-path", str(undefined), "--limit",
                 "2"]) == 1
    err = capsys.readouterr().err   # the datasets library's progress bar, then the line
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"tieflax evaluate: task tf_mc, {undefined / 'tf_mc.yaml'}, line {line}: the template '{{{{questio}}}}' does "
        "not render: 'questio' is undefined (the documents' fields: question, choices, answer)"), err


def test_torch_s_environment_report_is_collected_once_per_process(monkeypatch):
    """lm-eval collects torch's environment report (``pip list`` and shell commands in child processes) at
    every evaluation; a run with ``train.eval_tasks`` evaluates again and again: once per process, the same
    text in each evaluation's results."""
    from lm_eval.loggers.utils import add_env_info
    from torch.utils import collect_env

    from tieflax.eval import tasks

    calls = []
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: calls.append(1) or f"report {len(calls)}")
    monkeypatch.setattr(tasks, "_TORCH_REPORT", [])
    first, second = {}, {}
    with tasks.torch_report_once():
        add_env_info(first)
        add_env_info(second)
    assert len(calls) == 1 and first["pretty_env_info"] == second["pretty_env_info"] == "report 1"
    assert collect_env.get_pretty_env_info() == "report 2"   # lm-eval's own again outside an evaluation
