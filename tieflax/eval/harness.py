"""An lm-evaluation-harness backend for tieflax runs: ``TieflaxLM``, a ``TemplateLM`` (lm-eval 0.4.x).

    lm = TieflaxLM.from_workdir("runs/x")                    # the latest checkpoint, on the run's mesh
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], task_manager=TaskManager())

It mirrors lm-eval's reference ``hf`` backend request by request, so that a ``tieflax convert --to-hf``
export scored by ``hf`` gives the same per-sample numbers:

* loglikelihood: lm-eval's own context/continuation encoding (``TemplateLM``), left truncation to
  ``max_length + 1`` tokens, scored by the model's fused cross-entropy (fp32 log-softmax over the whole
  vocabulary, no [T, V] logits on any device); ``is_greedy`` is "every continuation token is the argmax".
  Requests are sorted by length and padded to a few length buckets, each batch holding
  ``token_budget`` tokens (rows = budget / bucket), so a task compiles a handful of shapes.
* loglikelihood_rolling: lm-eval's disjoint rolling windows of ``max_length`` tokens, prefixed by the
  prefix token.
* generate_until: a static KV cache (``tieflax.eval.decode``), greedy or with temperature; a row stops at
  EOS or at a token whose text holds a stop sequence; the text is cut at the first stop sequence as the
  ``hf`` backend does, and contexts are left-truncated to ``max_length - max_gen_toks`` tokens.

BOS policy: the run's documents open with ``data.tokenizer.bos_token`` when set, else with EOS; that
token is the prefix of empty contexts and rolling windows (``prefix_token_id``), as ``hf`` uses the
tokenizer's BOS (the export declares the same token as ``bos_token``). Strings are encoded as the
tokenizer's post-processor says (a published Llama-3 tokenizer adds its BOS; a trained BPE adds nothing).

Several processes (a pod, ``launch/local_multiprocess.sh``): lm-eval runs on process 0 alone (it reads
the tasks, writes the results); each batch it scores or generates is a program on the whole mesh, so
process 0 first sends it to the others (``tieflax.eval.requests``), which run it on their devices in the
same order (``follow()``) until process 0's ``leading()`` block ends. Results are replicated: the numbers
are those of one process on the same mesh.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from tieflax import sharding as shd
from tieflax.eval.decode import EvalError, Generator
from tieflax.eval.loaded import load_run, place_params, run_mesh  # noqa: F401 (re-exported)
from tieflax.model.config import ModelConfig

import flax.linen as nn


def length_buckets(max_length: int, smallest: int = 16) -> list[int]:
    """Padded lengths: powers of two from ``smallest``, and ``max_length`` itself last."""
    out, n = [], smallest
    while n < max_length:
        out.append(n)
        n *= 2
    return out + [max_length]


@register_model("tieflax")
class TieflaxLM(TemplateLM):
    """A tieflax model (config + params + tokenizer) as an lm-eval model.

    Args:
      config: the model's ``ModelConfig``; params: its parameters (host or placed on ``mesh``; scanned
        or per-layer); tokenizer: a ``tokenizers.Tokenizer``; eos_id / prefix_id: the end-of-text id and
        the id that opens a document (BOS, or EOS when the run has none).
      max_length: the context (the run's ``train.seq_len``); batch_size: sequences per generation batch
        (None: one per data x fsdp shard);
      token_budget: tokens per loglikelihood batch (rows = budget // padded length).
      mesh: the run's mesh (batches are split over data x fsdp, the vocabulary over tensor), or None.
      progress: this backend's own progress bars (off during training, which prints its own lines).
    """

    def __init__(self, config: ModelConfig, params: Any, tokenizer, *, eos_id: int, prefix_id: Optional[int] = None,
                 max_length: int, batch_size: Optional[int] = 8, token_budget: int = 4096, mesh=None,
                 max_gen_toks: int = 256, seed: int = 0, progress: bool = True):
        super().__init__()
        self.channel = None
        if jax.process_count() > 1:
            if mesh is None:
                raise EvalError("several processes evaluate on the run's mesh: give TieflaxLM the mesh")
            from tieflax.eval.requests import Channel  # noqa: PLC0415

            self.channel = Channel()
        self.config, self.params, self.tokenizer_ = config, params, tokenizer
        self.eos_id, self.prefix_id = eos_id, eos_id if prefix_id is None else prefix_id
        self.mesh = mesh
        self._max_length, self._max_gen_toks = max_length, max_gen_toks
        self.shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        batch_size = batch_size or self.shards
        if batch_size % self.shards:
            raise EvalError(f"--batch-size {batch_size} does not divide over the mesh's {self.shards} data x "
                            f"fsdp shards; use a multiple of {self.shards}")
        self._batch_size, self.token_budget = batch_size, token_budget
        from tieflax.model.transformer import TransformerLM  # noqa: PLC0415

        scoring = config.replace(remat="none", offload_layer_inputs=False)
        self.model = TransformerLM(scoring, mesh=mesh)
        self.generator = Generator(config, mesh=mesh, max_len=max_length, pad_id=eos_id)
        self.seed = seed
        self.progress = progress
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._score = jax.jit(self._score_fn, out_shardings=replicated)   # every process may read it

    # ------------------------------------------------------------------------------------- loading
    @classmethod
    def from_run(cls, run, *, step: Optional[int] = None, **kwargs) -> "TieflaxLM":
        """The checkpoint (latest, or ``step``), tokenizer and mesh of ``run``, opened by ``Run.read``."""
        loaded = load_run(run, step)
        return cls(loaded.config, loaded.params, loaded.tokenizer, eos_id=loaded.eos_id, prefix_id=loaded.bos_id,
                   max_length=loaded.max_length, mesh=loaded.mesh, **kwargs)

    @classmethod
    def from_workdir(cls, workdir: str, *, step: Optional[int] = None, **kwargs) -> "TieflaxLM":
        """``from_run`` of the run folder lm-eval names (``pretrained=RUN``) and the study passes."""
        from tieflax.run.read_only import ReadOnlyRun  # noqa: PLC0415

        return cls.from_run(ReadOnlyRun.open(workdir, command="evaluate"), step=step, **kwargs)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "TieflaxLM":
        """lm-eval's constructor: ``model="tieflax", model_args={"pretrained": RUN, "step": N,
        "token_budget": T}`` (the ``pretrained`` key also names lm-eval's output folder)."""
        args = dict(arg_dict)
        if "pretrained" not in args:
            raise EvalError("the tieflax lm-eval model needs model_args pretrained=RUN (a tieflax workdir)")
        kwargs = {k: int(args[k]) for k in ("step", "token_budget", "seed", "max_gen_toks") if args.get(k) is not None}
        batch_size = (additional_config or {}).get("batch_size")
        if batch_size not in (None, "auto"):
            kwargs["batch_size"] = int(batch_size)
        return cls.from_workdir(str(args["pretrained"]), **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "TieflaxLM":
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------------------------ lm-eval API
    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """As ``hf``: the tokenizer's special tokens are added unless asked not to, or unless the string
        already starts with the prefix token's text."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok_decode([self.prefix_id], skip_special_tokens=False))
        return self.tokenizer_.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer_.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------- loglikelihood
    def _score_fn(self, params, tokens, targets, valid):
        """tokens, targets [R, T] int32, valid [R, T] -> (log p(target) [R, T] fp32, argmax == target)."""
        from tieflax.model.transformer import TransformerLM  # noqa: F401, PLC0415

        loss, aux = self.model.apply({"params": params}, tokens, targets, None, valid.astype(jnp.int32),
                                     method="loss")
        return -loss, aux["correct"]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [(cache key, context ids, continuation ids)] -> [(sum log p, is_greedy)], in order."""
        rows = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise EvalError(f"a continuation of {len(continuation)} tokens cannot be scored with a context of "
                                f"{self.max_length} tokens; check the task's target text")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list = [None] * len(rows)
        buckets = length_buckets(self.max_length)
        params = self.scoring_params()
        pbar = tqdm(total=len(rows), disable=disable_tqdm or not self.progress, desc="tieflax loglikelihood")
        at = 0
        while at < len(order):
            length = next(b for b in buckets if b >= len(rows[order[at]][0]))
            per_batch = max(self.shards, (self.token_budget // length) // self.shards * self.shards)
            batch = order[at:at + per_batch]
            at += len(batch)
            tokens = np.full((per_batch, length), self.eos_id, np.int32)
            targets = np.full((per_batch, length), -1, np.int32)
            valid = np.zeros((per_batch, length), bool)
            for r, i in enumerate(batch):
                inp, tgt, n = rows[i]
                tokens[r, :len(inp)], valid[r, :len(inp)] = inp, True
                targets[r, len(inp) - n:len(inp)] = tgt[-n:]   # only the continuation is scored
            self._tell("score", tokens=tokens, targets=targets, valid=valid)
            logp, greedy = self._run_score(params, tokens, targets, valid)
            for r, i in enumerate(batch):
                scored = targets[r] >= 0
                answer = (float(logp[r][scored].sum()), bool(greedy[r][scored].all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            pbar.update(len(batch))
        pbar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihoods over lm-eval's disjoint windows of ``max_length`` tokens."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + window)
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        collator = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                            group_by="gen_kwargs", group_fn=lambda r: r[1])
        pbar = tqdm(total=len(requests), disable=disable_tqdm or not self.progress, desc="tieflax generate_until")
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        self._tell("layers")
        params = self.generator.layer_params(self.params)
        for chunk in collator.get_batched(n=self._batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = int(kwargs.pop("max_gen_toks"))
            if new >= self.max_length:
                raise EvalError(f"the task asks for {new} new tokens, more than the context of {self.max_length}; "
                                "lower the task's max_gen_toks")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            prompts = [self.tok_encode(c)[-(self.max_length - new):] for c in contexts]
            padded = list(prompts) + [prompts[0]] * (self._batch_size - len(prompts))  # one shape per task
            self.seed += 1
            stops = (self.eot_token_id, *self.tokens_containing(tuple(until)))
            width = max(len(p) for p in padded)
            self._tell("generate", prompts=np.array([list(p) + [0] * (width - len(p)) for p in padded], np.int32),
                       lengths=np.array([len(p) for p in padded], np.int32), new=np.int32(new),
                       stops=np.array(stops, np.int32), temperature=np.float64(temperature), seed=np.int64(self.seed))
            gen = self.generator.generate(params, padded, max_new_tokens=new, stop_ids=stops,
                                          temperature=temperature, seed=self.seed)
            for r, context in enumerate(contexts):
                text = self.tok_decode(gen.tokens[r, :gen.lengths[r]].tolist())
                text = postprocess_generated_text(text, until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
            pbar.update(len(contexts))
        pbar.close()
        return collator.get_original(out)

    # ---------------------------------------------------------------------------- several processes
    def _tell(self, kind: str, **arrays) -> None:
        if self.channel is not None:
            self.channel.send(kind, **arrays)

    def _run_score(self, params, tokens, targets, valid):
        with self._context():
            logp, greedy = self._score(params, *(self._place(x) for x in (tokens, targets, valid)))
        return np.asarray(logp), np.asarray(greedy)

    def leading(self):
        """Process 0's evaluation (``with lm.leading(): ...``): at its end the others stop following; an
        error ends their ``follow()`` with it too. Single-process: does nothing."""
        import contextlib  # noqa: PLC0415

        @contextlib.contextmanager
        def lead():
            try:
                yield
            except BaseException as e:
                if self.channel is not None:
                    self.channel.finish(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                raise
            if self.channel is not None:
                self.channel.finish()
        return lead()

    def follow(self) -> None:
        """Every process but 0: runs process 0's batches, in its order, until its evaluation ends."""
        layers = None
        while True:
            kind, a = self.channel.receive()
            if kind == "score":
                self._run_score(self.scoring_params(), a["tokens"], a["targets"], a["valid"])
            elif kind == "layers":
                layers = self.generator.layer_params(self.params)
            elif kind == "generate":
                prompts = [row[:n].tolist() for row, n in zip(a["prompts"], a["lengths"])]
                self.generator.generate(layers, prompts, max_new_tokens=int(a["new"]),
                                        stop_ids=tuple(int(x) for x in a["stops"]),
                                        temperature=float(a["temperature"]), seed=int(a["seed"]))
            elif kind == "failed":
                raise EvalError(f"process 0: {a['message']}")
            else:
                return

    # ------------------------------------------------------------------------------------- helpers
    def tokens_containing(self, stops: tuple[str, ...]) -> tuple[int, ...]:
        """Ids whose text contains a stop sequence: once one is generated the text to keep (cut at the
        first stop sequence) is settled, so its row may stop there. A stop sequence split over several
        tokens is still cut on the host, only later. Cached per stop tuple (one pass over the vocabulary)."""
        cache = self.__dict__.setdefault("_stop_tokens", {})
        if stops not in cache:
            stops_ = [s for s in stops if s]
            cache[stops] = tuple(i for i in range(self.config.vocab_size)
                                 if any(s in self.tok_decode([i], skip_special_tokens=False) for s in stops_))
        return cache[stops]

    def scoring_params(self):
        """Params in the layout the scoring model expects (scanned stays scanned)."""
        return nn.unbox(self.params)

    def _place(self, x: np.ndarray):
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(shd.BATCH_AXES)))

    def _context(self):
        return self.generator._context()
