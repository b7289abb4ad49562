"""The Megatron-Core policy: build from a HF checkpoint, logprobs, one optimizer step, HF export.

A batch is a dict of tensors on every rank (the controller broadcasts it): `tokens` [B, S] (prompt +
response, right-padded), `lengths` [B] (tokens of each sample; without it the whole row counts),
`loss_mask` [B, S] (1 on response tokens that train), and any other per-token [B, S] or per-sample
[B] fields the loss needs. Per-token values are aligned with `tokens`: index t holds the value for
the token *at* t (so logprobs[:, 0] is 0: nothing predicts it).

How the batch becomes micro-batches (packed rows by default, or padded slices) is
megatron_flash/trainer/micro_batches.py; the loss always sees a padded [n, w] view of its
micro-batch's samples. The caller's `loss_fn(micro_batch, logprobs, entropy) -> (loss_sum,
denominator, metrics)` follows Megatron's per-token loss contract (`calculate_per_token_loss=True`):
Megatron sums `loss_sum` and `denominator` over micro-batches and DP ranks and divides the gradient
once, so any packing, token budget, micro-batch × accumulation × DP split of the same batch gives the
same gradient. The trainer never looks at which loss it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_flash.trainer import context_parallel
from megatron_flash.trainer.distributed import Layout, init_distributed
from megatron_flash.hf.adapters import peft_config
from megatron_flash.hf.io import export_adapter, export_hf, load_hf_weights
from megatron_flash.trainer.flash_attention import attention_backend
from megatron_flash.trainer.flops import optimizer_state_bytes, step_speed
from megatron_flash.trainer.logprobs import vocab_parallel_logprobs
from megatron_flash.trainer.lora import (
    adapter_weights_per_token,
    adapters_off,
    apply_lora,
    check_lora,
    load_adapter,
    require_input_grad,
)
from megatron_flash.trainer.moe_metrics import moe_padding_mask
from megatron_flash.trainer.micro_batches import BatchingOptions, Micro, build_micro_batches, scatter_rows
from megatron_flash.trainer.model_builder import (
    DTYPES,
    moe_dispatcher,
    build_gpt_stage,
    padded_vocab_size,
    transformer_config,
    check_scale_options,
    resolve_te,
    validate_layout,
)
from megatron_flash.hf.spec import HFModelSpec, read_hf_spec
from megatron_flash.trainer.settings import PolicySettings
from megatron_flash.trainer.shared_prefix import UnsharedWarning, check_shared_prefix, sharing
from megatron_flash.trainer.weight_health import grad_state, weights_finite
from megatron_flash.types import TrainBatch

logger = logging.getLogger(__name__)

MicroBatchLossFn = Callable[[TrainBatch, torch.Tensor, Optional[torch.Tensor]],
                            tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
"""(the micro-batch's samples, their logprobs [n, w], entropy or None) → (loss sum, denominator,
metrics); trainer/loss_adapter.py makes one from a registry loss."""


def _require_batch(batch: Any, what: str) -> TrainBatch:
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"{what} takes a megatron_flash.types.TrainBatch, got {type(batch).__name__}")
    return batch


class MegatronPolicy:
    def __init__(self, settings: PolicySettings) -> None:
        self.settings = s = settings
        self.spec: HFModelSpec = read_hf_spec(s.hf_path)
        vpp = s.scale.virtual_pipeline_size
        validate_layout(self.spec, tp_size=s.tp_size, pp_size=s.pp_size, vpp_size=vpp, moe=s.moe,
                        sequence_parallel=s.scale.sequence_parallel,
                        recompute=s.scale.recompute)
        self.uses_te, te_note = resolve_te(s.use_transformer_engine, local_only=s.local_spec_reasons())
        if te_note and os.environ.get("RANK", "0") == "0":
            logger.info("%s", te_note)
        check_lora(self.spec, s.lora, uses_te=self.uses_te)
        check_shared_prefix(self.spec, enabled=s.shared_prefix, uses_te=self.uses_te)
        self.attention = attention_backend(s.attention_backend, uses_te=self.uses_te, dtype=s.dtype)
        check_scale_options(s.scale, optimizer=s.optimizer, uses_te=self.uses_te, moe=self.spec.moe is not None)
        self.layout: Layout = init_distributed(tp_size=s.tp_size, pp_size=s.pp_size, seed=s.seed, backend=s.backend,
                                               timeout_s=s.collective_timeout_s,
                                               vpp_size=vpp, cp_size=s.scale.context_parallel_size,
                                               ep_size=s.moe.ep_size, etp_size=s.moe.etp_size)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.config = transformer_config(self.spec, tp_size=s.tp_size, pp_size=s.pp_size, dtype=s.dtype, scale=s.scale,
                                         moe=s.moe)
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, divisible_by=s.make_vocab_size_divisible_by,
                                              tp_size=s.tp_size)
        # One model chunk per virtual pipeline stage (one chunk without interleaving); each chunk has
        # its own DDP wrapper, the optimizer and the schedule take the list.
        self.chunks: list[Any] = self._wrap_ddp(self._build_chunks())
        self.optimizer, self.scheduler = self._build_optimizer()
        self.router_stats = None
        self.routing: Any = None  # routing replay and its agreement metrics (MoE only)
        if self.spec.moe is not None:
            from megatron_flash.trainer.moe_metrics import RouterStats
            from megatron_flash.trainer.routing_replay import RoutingReplay

            self.router_stats = RouterStats(self.chunks, num_layers=self.spec.num_layers,
                                            num_experts=self.spec.moe.num_experts)
            self.routing = RoutingReplay(self.chunks, num_layers=self.spec.num_layers, top_k=self.spec.moe.top_k,
                                         replay=s.moe.routing_replay)
        self._reference: Optional[list[torch.nn.Module]] = None
        self._unshared_warning = UnsharedWarning(enabled=self.layout.rank == 0)

    @property
    def model(self) -> Any:
        """The model chunks as weight sync, checkpoints and export take them: the single chunk, or
        the list of chunks under interleaving."""
        return self.chunks[0] if len(self.chunks) == 1 else self.chunks

    def _build_chunks(self) -> list[torch.nn.Module]:
        s = self.settings
        stages = [None] if s.scale.virtual_pipeline_size is None else list(range(s.scale.virtual_pipeline_size))
        chunks = [build_gpt_stage(self.spec, config=self.config, make_vocab_size_divisible_by=s.make_vocab_size_divisible_by,
                                  transformer_engine=self.uses_te, attention=self.attention,
                                  vp_stage=v) for v in stages]
        load_hf_weights(chunks, s.hf_path, spec=self.spec, layout=self.layout, padded_vocab_size=self.padded_vocab)
        if s.lora.enabled:  # base frozen, adapters fresh or from model.lora.adapter_path
            apply_lora(chunks, s.lora, spec=self.spec, layout=self.layout,
                       adapter=load_adapter(s.lora, s.hf_path) if s.lora.adapter_path else None)
            require_input_grad(chunks)
        return chunks

    def _reference_model(self) -> list[torch.nn.Module]:
        """The frozen start checkpoint (π_ref for the KL penalty), same layout, built on first use.
        Costs one more copy of this rank's weights; no gradients, no optimizer state. With fresh LoRA
        adapters the start checkpoint is the base: the policy's own chunks run with adapters off."""
        if self.settings.lora.enabled and not self.settings.lora.adapter_path:
            return self.chunks
        if self._reference is None:
            chunks = self._build_chunks()
            for chunk in chunks:
                for p in chunk.parameters():
                    p.requires_grad_(False)
                chunk.eval()
            if self.routing is not None:
                self.routing.attach(chunks)
            self._reference = chunks
        return self._reference

    # ------------------------------------------------------------------ construction
    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.optimizer.use_distributed_optimizer,
        )
        wrapped = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
        return wrapped

    def _build_optimizer(self) -> tuple[Any, Any]:
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s, o = self.settings, self.settings.optimizer
        dtype = DTYPES[s.dtype]
        opt_config = MegatronOptimizerConfig(
            optimizer=o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=o.use_distributed_optimizer,
            **({"optimizer_cpu_offload": True, "optimizer_offload_fraction": o.cpu_offload_fraction}
               if o.cpu_offload_fraction > 0 else {}),
        )
        optimizer = get_megatron_optimizer(opt_config, self.chunks)
        if s.dtype == "float16":
            self.config.grad_scale_func = optimizer.scale_loss
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(s.optimizer_steps, 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(s.optimizer_steps, 1), wd_incr_style="constant",
        )
        return optimizer, scheduler

    # ------------------------------------------------------------------ batching
    def _batching(self) -> BatchingOptions:
        s, pp, ep = self.settings, self.layout.pp_size, self.layout.ep_size
        interleaved = len(self.chunks) > 1  # the interleaved schedule groups micro-batches by PP
        # Expert parallel: token dispatch is a collective across DP ranks in every micro-batch, and the
        # all-gather dispatcher needs the same token count on every rank.
        allgather = ep > 1 and moe_dispatcher(s.moe) == "allgather"
        return BatchingOptions(
            pack=s.pack_sequences, shared_prefix=s.shared_prefix,
            micro_batch_size=s.micro_batch_size, max_tokens=s.max_tokens_per_micro_batch,
            max_seq_len=s.max_seq_len, pad_multiple=s.tp_size,  # sequence parallel splits rows over TP
            equal_rows=pp > 1 or allgather, equal_counts=ep > 1, min_micro_batches=pp if interleaved else 1,
            micro_batch_multiple=pp if interleaved else 1, cp_size=self.layout.cp_size, cp_rank=self.layout.cp_rank,
            cp_group=context_parallel.group() if self.layout.cp_size > 1 else None,
        )

    def _micro_batches(self, batch: TrainBatch, *, share: bool = True) -> list[Micro]:
        opts = self._batching()
        if not share:
            opts = dataclasses.replace(opts, shared_prefix=False)
        return build_micro_batches(batch, opts, dp_rank=self.layout.dp_rank,
                                   dp_size=self.layout.dp_size, device=self.device)

    def _logprobs_of(self, output: torch.Tensor, m: Micro, *, temperature: float, with_entropy: bool
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Logprobs (and entropy) of the micro-batch's samples, [n, w] (the loss's view), and with a
        teacher top-K in the batch the student's logprobs of those K tokens, [n, w, K] (same pass)."""
        from megatron.core import parallel_state as ps

        tokens = m.tokens if m.row is None else m.row  # context parallelism: the whole row's
        targets = tokens[:, 1:]
        topk = m.fields.teacher_topk_ids
        if topk is not None:  # one pass for the sampled token and the teacher's K (loss-view → model row)
            targets = torch.cat([targets.unsqueeze(-1), m.pack(topk)[:, 1:].to(targets.device)], dim=-1)

        def score(out: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            return vocab_parallel_logprobs(
                out, tgt, vocab_size=self.spec.vocab_size, tp_rank=self.layout.tp_rank,
                tp_size=self.layout.tp_size, tp_group=ps.get_tensor_model_parallel_group(),
                temperature=temperature, with_entropy=with_entropy)

        if m.cp_order is None:
            lp, ent = score(output[:, :-1], targets)
        else:  # this rank's positions scored, then gathered into the row over the CP group
            lp, ent = context_parallel.score(score, output, targets, m, ps.get_context_parallel_group())
        if m.extra_src is not None:  # shared prefixes: each response's first token from the prompt's last logits
            pairs = m.fields.tokens[m.extra_rows, m.extra_cols]
            if topk is not None:
                pairs = torch.cat([pairs[:, None], topk[m.extra_rows, m.extra_cols]], dim=-1)
            lp_x, ent_x = score(output[:, m.extra_src], pairs[None].to(targets.device))
            lp = torch.cat([lp, lp_x], dim=1)  # the extras after the row: index T + k (trainer/shared_prefix.py)
            ent = None if ent is None else torch.cat([ent, ent_x], dim=1)
        top = None
        if topk is not None:
            lp, top = lp[..., 0], lp[..., 1:]
            top = m.unpack(torch.cat([top.new_zeros(top.shape[0], 1, top.shape[-1]), top], dim=1))
        zero = lp.new_zeros(lp.shape[0], 1)
        lp = m.unpack(torch.cat([zero, lp], dim=1))
        if ent is not None:
            ent = m.unpack(torch.cat([zero, ent], dim=1))
        return lp, ent, top

    @staticmethod
    def _forward_step(loss_factory: Callable[[Micro], Callable[[torch.Tensor], Any]], router_stats: Any,
                      routing: Any, data: Iterator[Micro], model: Any) -> tuple[torch.Tensor, Any]:
        m = next(data)
        if router_stats is not None:  # the routers of this forward see this micro-batch's tokens
            router_stats.current = m.real
        kwargs = {}
        if routing is not None:
            routing.before_forward(model, m.routes, m.routed)
            kwargs["padding_mask"] = moe_padding_mask(model, m.routable.to(m.tokens.device))
        output = model(m.tokens, m.positions, attention_mask=None,
                       packed_seq_params=m.packed_seq_params, **kwargs)
        return output, loss_factory(m)

    def _run(self, micro: list[Micro], *, forward_only: bool,
             loss_factory: Callable[[Micro], Callable[[torch.Tensor], Any]],
             chunks: Optional[list[torch.nn.Module]] = None) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = chunks if chunks is not None else self.chunks
        # Every chunk of an interleaved stage reads the same micro-batch sequence.
        data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_factory, self.router_stats, self.routing),
                data_iterator=data, model=chunks, num_microbatches=len(micro), seq_length=micro[0].row_len,
                micro_batch_size=int(micro[0].tokens.shape[0]), forward_only=forward_only,
            )
        finally:
            if self.routing is not None:
                self.routing.clear()

    def _gather(self, micro: list[Micro], store: list[dict[str, torch.Tensor]], key: str,
                shape: tuple[int, ...]) -> torch.Tensor:
        """Per-sample outputs of the last stage's micro-batches → [B, S, ...] on every rank."""
        from megatron.core import parallel_state as ps

        values = [d[key] for d in store] if self.layout.is_last_stage else []
        local = scatter_rows(micro, values, shape, self.device)
        if self.layout.pp_size > 1:
            dist.broadcast(local, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.layout.dp_size > 1:  # each sample lives on exactly one DP rank; the others hold 0
            dist.all_reduce(local, group=ps.get_data_parallel_group())
        return local.cpu()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, temperature: float = 1.0,
                         with_entropy: bool = False, reference: bool = False,
                         own_routing: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logprobs (and entropy) of `batch.tokens`, [B, S] on every rank (0 past each sample's
        `lengths`), forward only; of the frozen start checkpoint instead of the trained weights when
        `reference`. With routing replay on, the batch must carry its routes unless `own_routing`
        (sequences no engine generated, e.g. the post-sync probe)."""
        batch = _require_batch(batch, "compute_logprobs")
        self._check_routes(batch, required=not own_routing)
        micro = self._micro_batches(TrainBatch(tokens=batch.tokens, lengths=batch.lengths,
                                               loss_mask=torch.zeros_like(batch.tokens, dtype=torch.float32),
                                               routed_experts=batch.routed_experts, group_ids=batch.group_ids,
                                               prompt_lengths=batch.prompt_lengths))

        def factory(m: Micro) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                lp, ent, _ = self._logprobs_of(output, m, temperature=temperature, with_entropy=with_entropy)
                extra = {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}
                return lp.new_zeros(()), torch.tensor(1, dtype=torch.int), extra
            return loss_func

        chunks = self._reference_model() if reference else None
        with adapters_off(self.chunks) if reference and chunks is self.chunks else contextlib.nullcontext():
            store = self._run(micro, forward_only=True, loss_factory=factory, chunks=chunks)
        shape = tuple(batch.tokens.shape)
        lp = self._gather(micro, store, "logprobs", shape)
        return lp, (self._gather(micro, store, "entropy", shape) if with_entropy else None)

    @torch.no_grad()
    def compute_logits(self, tokens: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-vocabulary logits [B, S, V] on every rank (vocab padding stripped; 0 past each
        sample's `lengths`). For checks only: it gathers the vocabulary across TP, which the
        training path never does."""
        from megatron.core import parallel_state as ps

        micro = self._micro_batches(TrainBatch(tokens=tokens, lengths=lengths,
                                               loss_mask=torch.zeros_like(tokens, dtype=torch.float32)), share=False)

        def factory(m: Micro) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                parts = [torch.empty_like(output) for _ in range(self.layout.tp_size)]
                if self.layout.tp_size > 1:
                    dist.all_gather(parts, output.contiguous(), group=ps.get_tensor_model_parallel_group())
                else:
                    parts = [output]
                full = torch.cat(parts, dim=-1)[..., : self.spec.vocab_size].float()
                if m.cp_order is not None:  # this rank's positions → the whole row
                    full = context_parallel.gather_rows(full, m)
                if m.index is not None:  # packed: logit t predicts token t+1, keep it at column t
                    full = full[0][m.index.to(full.device)] * m.valid.to(full.device)[..., None]
                return full.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logits": full}
            return loss_func

        store = self._run(micro, forward_only=True, loss_factory=factory)
        return self._gather(micro, store, "logits", tuple(tokens.shape) + (self.spec.vocab_size,))

    def train_step(self, batch: TrainBatch, loss_fn: MicroBatchLossFn, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, Optional[float]]:
        """One optimizer step on `batch`. Returns metrics (token-weighted means) on every rank, and
        the step's speed (trainer/flops.step_speed: mfu, tokens_per_s_per_gpu, peak_mem_gb)."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        micro = self._micro_batches(self._check_routes(_require_batch(batch, "train_step")))

        def factory(m: Micro) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                lp, ent, top = self._logprobs_of(output, m, temperature=temperature, with_entropy=with_entropy)
                loss_sum, denom, metrics = loss_fn(m.fields, lp, ent, **({} if top is None else {"topk_logprobs": top}))
                report = {"loss_sum": loss_sum.detach().float(), "denominator": denom.detach().float()}
                for k, v in metrics.items():  # weight by the micro-batch's denominator
                    report[k] = v.detach().float() * denom.detach().float()
                # Megatron sums token counts over DP × CP: every CP rank computed this micro-batch's loss
                # over the whole row, CP rank 0 counts its tokens
                return loss_sum, denom.to(torch.int) * int(self.layout.cp_rank == 0), report
            return loss_func

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_stats is not None:
            self.router_stats.reset()
        if self.routing is not None:
            self.routing.counts.zero_()  # agreement of this step's training forwards only
        store = self._run(micro, forward_only=False, loss_factory=factory)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        finite, nonzero = grad_state(self.chunks, device=self.device)
        zero_skipped = finite and not nonzero and self.settings.optimizer.skip_zero_grad
        if zero_skipped:
            # Nothing to learn from (trainer/weight_health.py says why Adam must not step); the LR
            # schedule still follows the run's steps.
            update_ok, grad_norm = False, 0.0
            self.scheduler.step(increment=1)
        elif finite:
            update_ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        else:  # one NaN/inf gradient would poison every weight it reaches: no update, no LR step
            self.optimizer.zero_grad()
            update_ok, grad_norm = False, None
        # Finite gradients can still blow the weights up (a huge step): caught here, before any push.
        weights_bad = bool(update_ok) and not weights_finite(self.chunks, device=self.device)
        metrics = self._reduce_metrics(store, grad_norm=grad_norm, update_ok=update_ok)
        metrics["nonfinite_skipped"] = float(not finite)
        metrics["zero_grad_skipped"] = float(zero_skipped)
        metrics["weights_nonfinite"] = float(weights_bad)
        metrics["lr"] = lr
        metrics["micro_batches"] = float(len(micro))
        metrics["tokens_computed"] = float(sum(m.tokens.numel() for m in micro))
        metrics["optimizer_state_gb"] = optimizer_state_bytes(self.optimizer) / 1e9
        if self.router_stats is not None:
            metrics.update(self.router_stats.collect(len(micro), self.device))
            metrics.update(self.routing.collect(self.device))
        rows, width = batch.tokens.shape
        lengths = batch.lengths.tolist() if batch.lengths is not None else [width] * rows
        s, adapters = self.settings, adapter_weights_per_token(self.spec, self.settings.lora)
        shared = sharing(self.spec, batch, lengths, max_tokens=s.max_tokens_per_micro_batch,
                         max_samples=s.micro_batch_size, adapter_weights=adapters) if s.shared_prefix else None
        if shared is not None:
            metrics["shared_prefix_saved_frac"] = shared.saved_frac
            self._unshared_warning(shared.unshared)
        flops = shared.flops if shared else None
        metrics.update(step_speed(self.spec, lengths, seconds=time.perf_counter() - started,  # host-synced above
                                  num_gpus=self.layout.world_size, device=self.device, adapter_weights=adapters,
                                  flops=flops))
        return metrics

    def _check_routes(self, batch: TrainBatch, required: bool = True) -> TrainBatch:
        """Routing replay needs every sample's routes, laid out for this model."""
        routes = batch.routed_experts
        if self.routing is None:
            if routes is not None:
                raise ValueError(f"the batch carries routed_experts but {self.spec.architecture} is dense")
            return batch
        want = self.spec.num_layers * self.spec.moe.top_k
        if routes is None:
            if self.routing.replay and required:
                raise ValueError("trainer.moe_routing_replay=rollout but the batch's samples carry no "
                                 "routed_experts (engines not asked for routes, or groups dumped without them)")
            return batch
        if routes.shape[-1] != want:
            raise ValueError(f"routed_experts has {routes.shape[-1]} ids per token; this model routes "
                             f"{self.spec.num_layers} layers × top-{self.spec.moe.top_k} = {want}")
        if int(routes.max()) >= self.spec.moe.num_experts:
            raise ValueError(f"routed_experts names expert {int(routes.max())}; the model has "
                             f"{self.spec.moe.num_experts}")
        return batch

    def _reduce_metrics(self, store: list[dict[str, torch.Tensor]], *, grad_norm: Any, update_ok: bool) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        keys = sorted(store[0]) if store else []
        if self.layout.pp_size > 1:  # non-last stages learn the key list from the last one
            obj = [keys]
            dist.broadcast_object_list(obj, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            keys = obj[0]
        sums = torch.zeros(len(keys), device=self.device)
        if self.layout.is_last_stage:
            for d in store:
                sums += torch.stack([d[k].reshape(()) for k in keys])
        if self.layout.pp_size > 1:
            dist.broadcast(sums, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        if self.layout.dp_size > 1:
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
        total = dict(zip(keys, sums.tolist()))
        denom = max(total.pop("denominator", 0.0), 1e-12)
        out = {k: v / denom for k, v in total.items() if k != "loss_sum"}
        out["loss"] = total.get("loss_sum", 0.0) / denom
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["update_ok"] = float(bool(update_ok))
        return out

    def export_hf(self, out_dir: str) -> None:
        """HF checkpoint of the current weights (merged with the adapters), plus with LoRA the
        adapters alone in PEFT's format in `out_dir/adapter`."""
        export_hf(self.chunks, out_dir, spec=self.spec, layout=self.layout, source_dir=self.settings.hf_path,
                  adapter_config=self.peft_config())

    def export_adapter(self, out_dir: str) -> None:
        """The LoRA adapters alone, as a PEFT folder. Collective."""
        export_adapter(self.chunks, out_dir, spec=self.spec, layout=self.layout, config=self.peft_config())

    def peft_config(self) -> Optional[dict]:
        """adapter_config.json of this policy's adapters (None without LoRA)."""
        o = self.settings.lora
        if not o.enabled:
            return None
        return peft_config(rank=o.rank, alpha=o.alpha, dropout=o.dropout, targets=o.targets,
                           base_model=os.path.abspath(self.settings.hf_path))
