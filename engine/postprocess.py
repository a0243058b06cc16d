"""What happens to a sampled token, from append to free, in one place.

`Postprocessor.append` appends the token and its logprob to its sequence, detokenizes
incrementally when text is needed per step, checks the stops (stop token ids, EOS, stop strings,
`max_tokens`, the model length) and finishes the sequence, which frees its blocks at once.
`Postprocessor.output` turns a request into a `RequestOutput`: cumulative (everything so far) or
delta (only what is new since the last output, so a stream costs O(L) in all, not O(L^2)); text
that could still turn out to be the start of a stop string is held back until it cannot.
`Postprocessor.fail` ends one request whose own processing raised, leaving the rest of the batch
alone. Nothing else appends tokens, finishes sequences or builds outputs.
"""
from __future__ import annotations

import logging

from cuttle.engine.outputs import CompletionOutput, RequestOutput
from cuttle.engine.sampler import Logprob
from cuttle.engine.sampling_params import RequestOutputKind, SamplingParams
from cuttle.engine.scheduler import Scheduler
from cuttle.engine.sequence import Request, Sequence
from cuttle.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("cuttle.engine")


class Postprocessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int,
                 counters: dict[str, int]):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.counters = counters

    def attach_detokenizer(self, seq: Sequence) -> None:
        """Text per step is needed for stop strings and for streamed outputs; otherwise the text
        is decoded once, when the output is built."""
        req = seq.request
        p = req.sampling_params
        if self.tokenizer is not None and (p.stop or req.stream):  # no tokenizer: token ids only
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens], p.skip_special_tokens)

    # ---- one sampled token -----------------------------------------------------------------
    def append(self, seq: Sequence, token: int, logprob: float, top: dict[int, Logprob] | None) -> None:
        req = seq.request
        p = req.sampling_params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if p.logprobs is not None:
            seq.logprobs.append(self._decoded(top or {}))
        self.counters["generated_tokens"] += 1
        n_out = seq.num_output_tokens
        finish: str | None = None
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                finish, seq.stop_reason = "stop", token
            elif not p.ignore_eos and token in self.eos_token_ids:
                finish = "stop"
        # the text of the token that stopped the sequence is left out unless
        # include_stop_str_in_output (vLLM's rule; its id stays in token_ids)
        seq.stop_token_hidden = finish is not None and not p.include_stop_str_in_output
        if seq.detok is not None and not seq.stop_token_hidden:
            scanned = len(seq.output_text)
            seq.output_text += seq.detok.step(seq.token_ids)
            # text of the first min_tokens tokens never ends the sequence (vLLM's rule); a stop
            # string may still begin in it and end in a later token's text
            if finish is None and p.stop and n_out > p.min_tokens:
                finish = _check_stop_strings(seq, p, scanned)
        if finish is None and (n_out >= req.max_tokens or len(seq.token_ids) >= self.max_model_len):
            finish = "length"
        if finish is not None:
            seq.finish_reason = finish
            self.scheduler.finish(seq)

    def _decoded(self, lps: dict[int, Logprob]) -> dict[int, Logprob]:
        """`Logprob.decoded_token` filled (vLLM's: each token's own text, special tokens kept)."""
        if self.tokenizer is not None:
            for t, lp in lps.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.token_text(t)
        return lps

    # ---- ending a request ------------------------------------------------------------------
    def abort(self, req: Request) -> None:
        """End every unfinished sequence of `req` now; their blocks are free when this returns."""
        req.aborted = True
        req.forked = True
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"

    def fail(self, req: Request, error: Exception) -> None:
        """End one request after an exception in its own processing: its KV is freed now and its
        output says why; the other requests of the step carry on."""
        log.error("request %s failed; ending it alone", req.request_id, exc_info=error)
        req.error = f"{type(error).__name__}: {error}"
        self.abort(req)

    # ---- outputs ---------------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput:
        p = req.sampling_params
        delta = p.output_kind == RequestOutputKind.DELTA
        finished = req.is_finished or req.aborted
        outs = []
        for seq in req.seqs:
            text = self._text(seq, req)
            n_tok = len(seq.token_ids) - seq.num_prompt_tokens
            if delta and text is not None:
                # hold back what a stop string could still cut off, until the sequence ends
                upto = len(text) if seq.is_finished or finished else max(seq.sent_chars, len(text) - _stop_hold(p))
                first_tok, first_char = seq.sent_tokens, seq.sent_chars
                seq.sent_tokens, seq.sent_chars = n_tok, upto
                text = text[first_char:upto]
            elif delta:
                first_tok, seq.sent_tokens = seq.sent_tokens, n_tok
            else:
                first_tok = 0
            start = seq.num_prompt_tokens + first_tok
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.token_ids[start:],
                    cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
                    logprobs=seq.logprobs[first_tok:] if p.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        # prompt logprobs are recorded without text, in order: fill the new ones (back to a filled one)
        for lps in reversed(req.prompt_logprobs or ()):
            if lps:
                if next(iter(lps.values())).decoded_token is not None:
                    break
                self._decoded(lps)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.full_prompt_token_ids or req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=outs,
            finished=finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens + req.seqs[0].num_reused_tokens,
            num_cached_document_tokens=req.seqs[0].num_reused_tokens,
            num_cache_written_tokens=req.cache_written_tokens,
            metrics={"weight_version": req.weight_version},
            error=req.error,
            lora_request=req.lora_request,
        )

    def _text(self, seq: Sequence, req: Request) -> str | None:
        if seq.detok is not None:
            return seq.output_text
        if self.tokenizer is None:  # skip_tokenizer_init: vLLM's outputs carry text None then
            return None
        out_ids = seq.output_token_ids
        if seq.stop_token_hidden:
            out_ids = out_ids[:-1]
        try:
            return self.tokenizer.decode_continuation(req.prompt_token_ids, out_ids, req.sampling_params.skip_special_tokens)
        except Exception:
            if req.error is None:
                raise
            return ""  # the request already failed; its token ids still go back


def _stop_hold(p: SamplingParams) -> int:
    return max((len(s) for s in p.stop), default=1) - 1


def _check_stop_strings(seq: Sequence, p: SamplingParams, scanned: int) -> str | None:
    """The first stop string in the text; only the part that could hold a new match is searched
    (text before `scanned` was searched when it arrived)."""
    text = seq.output_text
    for s in p.stop:
        i = text.find(s, max(0, scanned - len(s) + 1))
        if i != -1:
            seq.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
            seq.stop_reason = s
            return "stop"
    return None
