"""One choice of an answer as its Events come (`Choice`: its text so far, tokens, log-probabilities, finish
reason), and the pieces of OpenAI's bodies made of choices: a chat's message, the log-probabilities listed
(vLLM's `prompt_logprobs` entries, a text completion's likeliest tokens), the usage counted.
"""

from __future__ import annotations

import time

from jaxformer.serve.protocol import Job, TextStream
from jaxformer.serve.tools import CallStream


class Choice:
    """One choice's state: its text so far (TextStream), tokens, log-probabilities and finish reason.

    Args:
        tok (Tokenizer): decodes its tokens.
        job: the request it answers.
        index: its place among the job's choices (prompt x n + choice).
        scores: each prompt's scores (the app's `_score`), or None.
        on_end (Callable | None): called once with (the choice, its finish reason) when it ends.
    """

    def __init__(self, tok, job: Job, index: int, scores: list[dict] | None = None, on_end=None):
        self.tok, self.index, self.on_end = tok, index, on_end  # on_end(choice, reason): once, when it ends
        self.prompt = job.prompts[index // job.n]
        self.scores = None if scores is None else scores[index // job.n]  # the prompt's (the app's `_score`)
        self.echo = job.prompt_texts[index // job.n] if job.echo else ""
        self.stream = TextStream(tok, job.stop, getattr(tok, "eos_id", None), job.shown_stops)
        self.calls = None if job.tools is None else CallStream(job.tools)  # a streamed chat's deltas under tools
        self.top_n = job.top_logprobs
        self.text, self.tokens, self.logprobs = self.echo, [], []  # logprobs: (id, log-probability, likeliest)
        self.done = self.engine_done = False
        self.finish_reason = self.first_at = self.last_at = None  # its first and last tokens' time.monotonic()

    def take(self, event, abort) -> str:
        """Take one of its engine request's Events.

        Args:
            event (Event): the engine's event.
            abort (Callable): stops its engine request (called where a stop string ends the text first).

        Returns:
            The text that can be handed out now.
        """
        if self.done:
            return ""
        if event.token_ids:
            self.last_at = time.monotonic()
            self.first_at = self.first_at or self.last_at
        self.tokens += event.token_ids
        tops = event.top_logprobs or [None] * len(event.token_ids)
        self.logprobs += list(zip(event.token_ids, event.logprobs or [], tops, strict=False))
        piece = self.stream.add(event.token_ids)
        self.engine_done = event.finished
        if self.stream.stopped:
            self.done, self.finish_reason = True, "stop"
            if not event.finished:
                abort()
        elif event.finished:
            piece += self.stream.flush()
            self.done, self.finish_reason = True, event.finish_reason
        self.text += piece
        if self.done:
            self.end(self.finish_reason)
        return piece

    def end(self, reason: str) -> None:
        """It ended: counted once.

        Args:
            reason: its finish reason, or "abort".
        """
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(self, reason)

    def text_logprobs(self, triples: list, whole: bool = False) -> dict:
        """OpenAI's logprobs of a text completion: the chosen tokens' and, where asked (`logprobs` > 0), the
        likeliest tokens' at each ({text: log-probability}).

        Args:
            triples: (id, log-probability, likeliest (id, log-probability) pairs or None) of its tokens.
            whole: the whole answer's: with a scored prompt, the prompt's tokens first, the first one's None.

        Returns:
            {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.
        """
        tokens = [self.tok.decode([t]) for t, _, _ in triples]
        lps = [lp for _, lp, _ in triples]
        tops = [top_texts(self.tok, top) for _, _, top in triples] if self.top_n else None
        if whole and self.scores is not None and self.scores["echo"] is not None:
            s = self.scores["echo"]
            return {"tokens": s["tokens"] + tokens, "token_logprobs": s["token_logprobs"] + lps,
                    "top_logprobs": s["top_logprobs"] + (tops or [{}] * len(triples)), "text_offset": None}  # fmt: skip
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": None}

    def chat_logprobs(self, triples: list) -> dict:
        """OpenAI's logprobs of a chat completion: each chosen token's and its likeliest tokens' (`top_logprobs`).

        Args:
            triples: (id, log-probability, likeliest (id, log-probability) pairs or None) of its tokens.

        Returns:
            {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.
        """
        entry = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content = []
        for t, lp, top in triples:
            tops = [entry(self.tok.decode([i]), x) for i, x in top or ()]
            content.append(entry(self.tok.decode([t]), lp) | {"top_logprobs": tops})
        return {"content": content}


def chat_choice(c: Choice, job: Job) -> dict:
    """A whole chat choice: its message (under tools, its calls and the content before them) and finish reason.

    Args:
        c: the choice, ended.
        job: its request.

    Returns:
        {"index", "message", "logprobs", "finish_reason"}.
    """
    message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
    if job.tools is not None:
        content, calls, reason = job.tools.answer(c.text, c.finish_reason)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
    logprobs = c.chat_logprobs(c.logprobs) if job.logprobs else None
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def ranked(tok, token: int, logp: float, rank: int, top: list, top_logp: list, n: int) -> dict[str, dict]:
    """One prompt position as vLLM's `prompt_logprobs` lists it: {id: {"logprob", "rank", "decoded_token"}}
    for the prompt's token there (its rank: the ids at least as likely, itself included), then the `n`
    likeliest (ranks 1 to n) not already listed.

    Args:
        tok (Tokenizer): decodes each id.
        token: the prompt's token at the position.
        logp: its log-probability.
        rank: its rank.
        top: the likeliest ids there, likeliest first (at least `n`).
        top_logp: their log-probabilities.
        n: how many of them are listed.

    Returns:
        The dict, its keys the ids as strings (JSON's).
    """
    entry = lambda i, lp, r: {"logprob": float(lp), "rank": int(r), "decoded_token": tok.decode([int(i)])}
    out = {str(int(token)): entry(token, logp, rank)}
    for r, (i, lp) in enumerate(zip(top[:n], top_logp[:n], strict=True), 1):
        out.setdefault(str(int(i)), entry(i, lp, r))
    return out


def top_texts(tok, pairs: list) -> dict[str, float]:
    """The likeliest tokens at one position as OpenAI's text completions list them: {text: log-probability},
    likeliest first (of two ids of one text, the likelier's).

    Args:
        tok (Tokenizer): decodes each id.
        pairs: (id, log-probability) pairs, likeliest first.

    Returns:
        The dict.
    """
    out: dict[str, float] = {}
    for i, lp in pairs:
        out.setdefault(tok.decode([int(i)]), float(lp))
    return out


def usage_of(job: Job, choices: list[Choice]) -> dict:
    """OpenAI's usage of an answer: its prompts' tokens (once each, however many choices) and its choices'.

    Args:
        job: the request.
        choices: its choices.

    Returns:
        {"prompt_tokens", "completion_tokens", "total_tokens"}.
    """
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def counts_of(c: Choice) -> dict:
    """One choice's usage so far (vLLM's continuous_usage_stats): its prompt's tokens and its own.

    Args:
        c: the choice.

    Returns:
        {"prompt_tokens", "completion_tokens", "total_tokens"}.
    """
    return {
        "prompt_tokens": len(c.prompt),
        "completion_tokens": len(c.tokens),
        "total_tokens": len(c.prompt) + len(c.tokens),
    }
