"""jaxformer as an lm-evaluation-harness model: `JaxformerLM`, registered under the name `jaxformer`.

Importing this module needs the `eval` extra (`pip install -e ".[eval]"`: the harness's core, no torch).
Requests are cut into tokens by the harness's own `TemplateLM` rules, as its `hf` model cuts them
(trailing spaces of a context move to the continuation; decoder_only encodes context + continuation
together and splits, encoder_decoder encodes them apart), so the numbers mean what the `hf` model's
mean. `loglikelihood` and `loglikelihood_rolling` run through `jaxformer.evaluation.scoring` (a
batched, jitted forward pass); `generate_until` through `jaxformer.engine.Engine` (continuous
batching; greedy, EOS and the request's stop strings end a generation, the text cut at the first stop).
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxformer.evaluation.scoring import Scorer, ScoringError, load


class HarnessError(ValueError):
    """A request or a setting the jaxformer model cannot serve, said in one line."""


@register_model("jaxformer")
class JaxformerLM(TemplateLM):
    """An lm-eval model over a jaxformer workdir, an exported directory or a Hugging Face model directory.

    `--model_args workdir=W` (or `hf=DIR`), with `batch_size` (rows per forward pass, default 16) and
    `max_gen_toks` (the default for tasks that name none, 256 as the `hf` model's).

    Args:
        workdir (str | None): a jaxformer workdir (or exported directory).
        hf (str | None): a Hugging Face model directory, instead of `workdir`.
        model (Transformer | None): a model already built (with `tokenizer`), instead of either.
        tokenizer (Tokenizer | None): the model's tokenizer (with `model`).
        batch_size (int | str): rows per forward pass (the harness passes it as text).
        max_gen_toks (int | str): new tokens at most where a task names no limit.
        engine (EngineConfig | None): the generation engine's settings (None: defaults, max_slots = batch_size).

    Raises:
        HarnessError: an encoder_only model, or a bad setting.
    """

    def __init__(
        self,
        workdir=None,
        hf=None,
        model=None,
        tokenizer=None,
        batch_size=16,
        max_gen_toks=256,
        engine=None,
        **unused,
    ):
        super().__init__()
        if unused:  # the harness passes its own settings (device, dtype...) to every model
            unused = {k: v for k, v in unused.items() if k not in ("device", "dtype", "trust_remote_code")}
        if unused:
            raise HarnessError(
                f"unknown model_args {sorted(unused)}: jaxformer takes workdir, hf, batch_size, max_gen_toks"
            )
        if model is None:
            model, tokenizer = load(workdir, hf)
        elif tokenizer is None:
            raise HarnessError("model= needs its tokenizer= too")
        try:
            self._batch_size = int(batch_size)
            self._max_gen_toks = int(max_gen_toks)
        except ValueError:
            raise HarnessError(
                f"batch_size={batch_size!r} and max_gen_toks={max_gen_toks!r} must be integers"
            ) from None
        if self._batch_size < 1 or self._max_gen_toks < 1:
            raise HarnessError(f"batch_size={batch_size} and max_gen_toks={max_gen_toks} must be >= 1")
        self.model, self.tok = model, tokenizer
        self.hf_tokenizer = hasattr(tokenizer, "tokenizer")  # jaxformer's HFTokenizer wraps the `tokenizers` one
        try:
            self.scorer = Scorer(model, self._batch_size, bos_id=getattr(tokenizer, "bos_id", None))
        except ScoringError as e:
            raise HarnessError(str(e)) from None
        self.backend = "seq2seq" if self.scorer.seq2seq else "causal"
        self.max_length = model.cfg.max_len
        self._engine_cfg, self._engine = engine, None

    # ------------------------------------------------------------------ the harness's token rules

    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (the tokenizer's EOS)."""
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and each rolling window's first) is conditioned on: as the `hf` model, a
        Hugging Face tokenizer's BOS, else its EOS; jaxformer's own corpora are documents each ending in
        EOS, with no BOS, so a document follows an EOS: EOS."""
        bos = getattr(self.tok, "bos_id", None)
        if self.hf_tokenizer and bos is not None and self.backend == "causal":
            return bos
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Text -> ids. decoder_only: no special tokens (the `hf` model's causal default). encoder_decoder
        contexts (add_special_tokens None or True): as the model's sources were, a Hugging Face
        tokenizer's template (T5: `</s>` after), jaxformer's tokenizers EOS after.

        Args:
            string: the text.
            add_special_tokens: the harness's flag (None: the default for the backend).
            **kwargs (object): the harness's other settings (left_truncate_len).

        Returns:
            The ids.
        """
        special = self.backend == "seq2seq" and add_special_tokens is not False
        if self.hf_tokenizer:
            ids = self.tok.tokenizer.encode(string, add_special_tokens=special).ids
        else:
            ids = self.tok.encode(string) + ([self.tok.eos_id] if special else [])
        cut = kwargs.get("left_truncate_len")
        return ids[-cut:] if cut else ids

    def tok_decode(self, ids) -> str:
        """Ids -> text, special tokens skipped.

        Args:
            ids (list[int]): token ids.

        Returns:
            The text.
        """
        return self.tok.decode(ids)

    # ------------------------------------------------------------------ requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (log-likelihood, is_greedy) each."""
        try:
            results = self.scorer.loglikelihoods([(c, x) for _, c, x in requests])
        except ScoringError as e:
            raise HarnessError(str(e)) from None
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood: its tokens in disjoint windows of max_len, each conditioned on the
        tokens before it (the first on `prefix_token_id`), as the `hf` model windows them.

        Args:
            requests (list[Instance]): each with args (document,).
            disable_tqdm: unused (no progress bar).

        Returns:
            One summed log-likelihood per document.
        """
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string, add_special_tokens=False)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _engine_for(self):
        from jaxformer.config import EngineConfig
        from jaxformer.engine import Engine

        if self._engine is None:
            cfg = self._engine_cfg or EngineConfig(max_slots=self._batch_size)
            bos = getattr(self.tok, "bos_id", None)
            self._engine = Engine(self.model, cfg, tokenizer=self.tok, eos_id=self.tok.eos_id, bos_id=bos)
        return self._engine

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each ended by EOS, its task's stop strings (`until`) or `max_gen_toks`,
        cut at the first stop string; the context left-truncated to leave room for max_gen_toks
        (decoder_only) as the `hf` model does.

        Args:
            requests (list[Instance]): each with args (context, generation kwargs).
            disable_tqdm: unused (no progress bar).

        Returns:
            One generated text per request.

        Raises:
            HarnessError: sampling asked for, or max_gen_toks that leaves no room for a context.
        """
        from jaxformer.engine import SamplingParams

        engine = self._engine_for()
        eos = self.tok.decode([self.eot_token_id])
        prompts, sources, params, stops = [], [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            n = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise HarnessError("generate_until: only greedy decoding is served (do_sample=false, temperature=0)")
            if self.backend == "causal":
                room = self.max_length - n
                if room <= 0:
                    raise HarnessError(
                        f"the task asks for up to max_gen_toks={n} new tokens; the model's context is "
                        f"model.max_len={self.max_length}: no room for a prompt"
                    )
                prompts.append(self.tok_encode(context, left_truncate_len=room))
                sources.append(None)
            else:
                source = self.tok_encode(context, left_truncate_len=self.max_length)
                # The hf model asks generate() for max_length = context width + max_gen_toks, which a seq2seq
                # model counts on the decoder side (its start token included): as many new tokens, here.
                n = min(len(source) + n - 1, self.max_length - 1)
                prompts.append([])
                sources.append(source)
            params.append(SamplingParams(max_tokens=n, temperature=0.0, stop=tuple(s for s in until if s)))
            stops.append(until)
        outputs = engine.generate(prompts, params, sources=None if self.backend == "causal" else sources)
        texts = []
        for req, out, until in zip(requests, outputs, stops, strict=True):
            # The engine's text is cut before the first stop string as the hf model cuts it (its tokens may not be).
            text = out.text if out.text is not None else self.tok.decode(out.token_ids)
            text = postprocess_generated_text(text, until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts
