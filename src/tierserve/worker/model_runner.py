"""ModelRunner: owns the model, the KV cache tensors and per-request sampling state.

It receives a SchedulerOutput (ints and lists), packs it into tensors (the paged kernel's
queries first, then prefill chunks for SDPA; in the lean step over a bfloat16 cache every
row is such a query, see `_paged`), runs one forward pass, computes logits only for the
sequences that sample, and returns a RunnerOutput (ints). Nothing here decides what runs.
"""

import torch

from tierserve.core.scheduler import RunnerOutput, ScheduledSeq, SchedulerOutput
from tierserve.errors import ConfigError, InvalidRequestError
from tierserve.model import cpu_attention, cpu_step, kernels
from tierserve.model.cpu_linear import pack_linears
from tierserve.model.llama import AttentionMetadata, LlamaModel, PrefillChunk
from tierserve.sampling_params import SamplingParams
from tierserve.worker.grammar import GrammarState
from tierserve.worker.sampler import SamplingState, sample


def _decodes(seq: ScheduledSeq) -> bool:
    """Whether the seq's positions are the paged kernel's queries in any runner: one
    token, or a speculating decode (one query per position). Prompt chunks: `_paged`."""
    return seq.is_decode or len(seq.token_ids) == 1


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0,
                 kv_cache_dtype: str = "auto"):
        pack_linears(model)  # where this CPU packs the weights' dtype (cpu_linear)
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = model.shape
        use_kernel = self.device.type == "cpu" and cpu_attention.supports(
            shape.num_heads, shape.num_kv_heads, shape.head_dim)
        self.decode_kernel = kernels.load() if use_kernel else None
        lean = self.decode_kernel is not None and cpu_step.supports(shape)
        if kv_cache_dtype == "int8" and not lean:
            raise ConfigError(cpu_step.int8_kv_refusal(shape, self.device.type,
                                                       self.decode_kernel))
        self.kv_caches = cpu_step.new_kv_caches(shape, num_blocks, block_size, self.dtype,
                                                kv_cache_dtype, self.device)
        """Per layer (k, v) in the model's dtype, or (k, v, k_scales, v_scales) in int8."""
        self.lean = None
        """The whole forward pass in one C++ call (model/cpu_step.py), where it applies."""
        if lean:
            self.lean = cpu_step.LeanForward(self.decode_kernel, model, self.kv_caches)
        self.paged_prefill = lean and kv_cache_dtype != "int8"
        """Prefill chunks' attention by the paged kernel (see _paged), in the lean step and
        in the Python layers alike where a test or benchmark routes a step through them."""
        self.states: dict[str, SamplingState] = {}
        self._seed_stream = torch.Generator().manual_seed(seed)

    def add_request(self, request_id: str, params: SamplingParams, eos_token_id: int | None,
                    prompt_token_ids: list[int] = (), grammar=None):
        """`grammar`: the request's CompiledGrammar (worker/grammar.py), if it has one."""
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_stream))
        banned = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            banned.append(eos_token_id)
        vocab = self.model.shape.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias names a token id beyond the vocabulary "
                                      f"({vocab} tokens)", param="logit_bias")
        self.states[request_id] = state = SamplingState.create(
            params, torch.Generator().manual_seed(seed), banned, vocab, list(prompt_token_ids))
        if grammar is not None:
            state.grammar = GrammarState(grammar)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        seqs = sorted(output.seqs, key=lambda s: not self._paged(s))   # decode queries first
        input_ids, positions, attn, sample_rows = self._prepare(seqs)
        if self.lean is not None:
            hidden = self.lean(self.model.embed(input_ids), positions, attn)
        else:
            hidden = self.model(input_ids, positions, attn, self.kv_caches)
        sampled = [s for s in seqs if s.sample]
        if not sampled:
            return RunnerOutput()
        head = self.lean.logits if self.lean is not None else self.model.compute_logits
        logits = head(hidden[sample_rows])
        out = RunnerOutput()
        row, rows = 0, []
        for s in sampled:                       # each seq's first logits row
            rows.append(row)
            row += 1 + s.num_draft
        plain = [i for i, s in enumerate(sampled) if not s.num_draft]
        if plain:   # (no speculating decode: the rows are the logits, not copied)
            tokens = sample(logits if len(plain) == row else logits[[rows[i] for i in plain]],
                            [self.states[sampled[i].request_id] for i in plain],
                            [sampled[i].num_output_tokens for i in plain])
            out.sampled_token_ids = {sampled[i].request_id: t for i, t in zip(plain, tokens)}
        for i, s in enumerate(sampled):
            if s.num_draft:
                kept = self._verify(s, logits[rows[i]:rows[i] + 1 + s.num_draft])
                out.sampled_token_ids[s.request_id] = kept[0]
                out.more_token_ids[s.request_id] = kept[1:]
        out.logprobs = {s.request_id: self.states[s.request_id].last_logprob for s in sampled
                        if self.states[s.request_id].params.logprobs is not None}
        return out

    def _verify(self, seq: ScheduledSeq, logits: torch.Tensor) -> list[int]:
        """A speculating decode's tokens: each position sampled as a decode step would
        sample it (one draw of the request's generator, its penalties and grammar as of
        the tokens kept before), up to and including the first that is not its draft."""
        state = self.states[seq.request_id]
        drafts = seq.token_ids[-seq.num_draft:]
        kept = []
        for i in range(seq.num_draft + 1):
            token = sample(logits[i:i + 1], [state], [seq.num_output_tokens + i])[0]
            kept.append(token)
            if i == seq.num_draft or token != drafts[i]:
                break
        return kept

    def _prepare(self, seqs: list[ScheduledSeq]):
        bs = self.block_size
        input_ids, positions, slots, sample_rows = [], [], [], []
        decodes, prefills = [], []
        for seq in seqs:
            start, n = seq.start_pos, len(seq.token_ids)
            offset = len(input_ids)
            input_ids += seq.token_ids
            positions += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if seq.sample:   # a speculating decode samples each of its positions
                sample_rows += range(offset + n - 1 - seq.num_draft, offset + n)
            if self._paged(seq):
                decodes += [(seq, start + i) for i in range(n)]
            else:
                prefills.append((seq, offset))
        attn = AttentionMetadata(
            slot_mapping=self._tensor(slots), num_decodes=len(decodes),
            decode_block_tables=None, decode_mask=None, decode_context_lens=None,
            decode_kernel=self.decode_kernel,
            prefills=[self._prefill_chunk(seq, offset) for seq, offset in prefills])
        if decodes:
            attn.decode_block_tables, attn.decode_mask = self._decode_tables(decodes)
            attn.decode_context_lens = self._tensor([pos + 1 for _, pos in decodes])
        return (self._tensor(input_ids), self._tensor(positions), attn,
                self._tensor(sample_rows))

    def _paged(self, seq: ScheduledSeq) -> bool:
        """Whether each of the seq's positions is a query of the paged kernel over its own
        context (the step stores every row's K and V before attending). A decode's, and a
        speculating decode's, so verifying drafts costs what decoding that many rows does.
        In the lean step a prefill chunk's too: torch's CPU flash attention took 15% of a
        64-stream closed loop over 128-token prompts (5.1 s of 34, in chunks with cached
        context over gathered blocks and a mask), and the kernel reads each position's
        context in place (2-core EPYC Zen 4, 4-bit; docs/benchmarks.md). Against float32,
        teacher-forced, its mean KL is SDPA's (bf16 0.00089 against 0.00090, gguf 0.00396
        against 0.00386: `benchmarks/quant_quality.py --lean`). Not with the int8 KV cache,
        whose kernel rounds each query to int8 too: prompt rows of random tokens then
        moved by a KL of 0.31 from the bfloat16 cache's (measured with the replay in
        tests/test_lean_step.py's int8 test, whose bound is 0.2), where SDPA over the
        widened keys stays under 0.07."""
        return _decodes(seq) or self.paged_prefill

    def _decode_tables(self, decodes: list[tuple[ScheduledSeq, int]]):
        """Block tables (and, without the kernel, masks) of decode queries: (seq, position)."""
        width = max(len(s.block_table) for s, _ in decodes)
        seqs, counts = [], []                 # one table per seq, repeated per query
        for s, _ in decodes:
            if seqs and seqs[-1] is s:
                counts[-1] += 1
            else:
                seqs.append(s)
                counts.append(1)
        tables = self._tensor([s.block_table + [0] * (width - len(s.block_table))
                               for s in seqs])
        if len(seqs) < len(decodes):
            tables = tables.repeat_interleave(self._tensor(counts), dim=0)
        if self.decode_kernel is not None:
            return tables, None                       # the kernel needs no mask
        key_pos = torch.arange(width * self.block_size, device=self.device)
        query_pos = self._tensor([pos for _, pos in decodes])
        mask = (key_pos.unsqueeze(0) <= query_pos.unsqueeze(1))          # [D, L]
        return tables, mask[:, None, None, :]

    def _prefill_chunk(self, seq: ScheduledSeq, offset: int) -> PrefillChunk:
        n = len(seq.token_ids)
        if seq.start_pos == 0:
            return PrefillChunk(offset, offset + n, None, None)
        num_blocks = -(-(seq.start_pos + n) // self.block_size)
        key_pos = torch.arange(num_blocks * self.block_size, device=self.device)
        query_pos = torch.arange(seq.start_pos, seq.start_pos + n, device=self.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)              # [n, L]
        return PrefillChunk(offset, offset + n, self._tensor(seq.block_table[:num_blocks]), mask)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
