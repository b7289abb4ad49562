"""The Megatron-Core policy: build from a HF checkpoint, logprobs, one optimizer step, HF export.

A batch is a dict of tensors on every rank (the controller broadcasts it): `tokens` [B, S] (prompt +
response, right-padded), `loss_mask` [B, S] (1 on response tokens that train), and any other per-
token [B, S] or per-sequence [B] fields the loss needs. Per-token values are aligned with `tokens`:
index t holds the value for the token *at* t (so logprobs[:, 0] is 0: nothing predicts it).

Each DP rank takes a contiguous B / DP slice, cut into micro-batches of `micro_batch_size`; all
micro-batches of a call share one padded length S, which pipeline P2P shapes require. The caller's
`loss_fn(micro_batch, logprobs, entropy) -> (loss_sum, denominator, metrics)` follows Megatron's
per-token loss contract (`calculate_per_token_loss=True`): Megatron sums `loss_sum` and
`denominator` over micro-batches and DP ranks and divides the gradient once, so any micro-batch ×
accumulation × DP split of the same batch gives the same gradient. The trainer never looks at which
loss it runs.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_flash.config.schema import OptimizerConfig
from megatron_flash.trainer.distributed import Layout, init_distributed
from megatron_flash.trainer.hf_io import export_hf, load_hf_weights
from megatron_flash.trainer.logprobs import vocab_parallel_logprobs
from megatron_flash.trainer.model_builder import (
    DTYPES,
    build_gpt_stage,
    padded_vocab_size,
    transformer_config,
    validate_layout,
)
from megatron_flash.weight_sync.hf_spec import HFModelSpec, read_hf_spec

LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor, Optional[torch.Tensor]],
                  tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclasses.dataclass
class PolicySettings:
    """What the policy needs from the run config; the optimizer section is the config's own."""

    hf_path: str
    tp_size: int = 1
    pp_size: int = 1
    dtype: str = "float32"
    micro_batch_size: int = 4
    seed: int = 1234
    total_steps: int = 100
    make_vocab_size_divisible_by: int = 128
    use_transformer_engine: str = "auto"
    backend: str = "auto"
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        self.optimizer.validate()

    @classmethod
    def from_run_config(cls, cfg: Any) -> "PolicySettings":
        return cls(
            hf_path=cfg.model.hf_path, tp_size=cfg.parallel.tensor_model_parallel_size,
            pp_size=cfg.parallel.pipeline_model_parallel_size, dtype=cfg.model.dtype,
            micro_batch_size=cfg.trainer.micro_batch_size, seed=cfg.trainer.seed,
            total_steps=cfg.trainer.total_steps, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
            use_transformer_engine=cfg.model.use_transformer_engine, backend=cfg.parallel.backend,
            optimizer=cfg.optimizer,
        )


class MegatronPolicy:
    def __init__(self, settings: PolicySettings) -> None:
        self.settings = s = settings
        self.spec: HFModelSpec = read_hf_spec(s.hf_path)
        validate_layout(self.spec, tp_size=s.tp_size, pp_size=s.pp_size)
        self.layout: Layout = init_distributed(tp_size=s.tp_size, pp_size=s.pp_size, seed=s.seed, backend=s.backend)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.config = transformer_config(self.spec, tp_size=s.tp_size, pp_size=s.pp_size, dtype=s.dtype)
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, divisible_by=s.make_vocab_size_divisible_by,
                                              tp_size=s.tp_size)
        stage = build_gpt_stage(self.spec, config=self.config, make_vocab_size_divisible_by=s.make_vocab_size_divisible_by,
                                use_transformer_engine=s.use_transformer_engine)
        load_hf_weights(stage, s.hf_path, spec=self.spec, layout=self.layout, padded_vocab_size=self.padded_vocab)
        self.model = self._wrap_ddp(stage)
        self.optimizer, self.scheduler = self._build_optimizer()
        self._reference: Optional[torch.nn.Module] = None

    def _reference_model(self) -> torch.nn.Module:
        """The frozen start checkpoint (π_ref for the KL penalty), same layout, built on first use.
        Costs one more copy of this rank's weights; no gradients, no optimizer state."""
        if self._reference is None:
            s = self.settings
            stage = build_gpt_stage(self.spec, config=self.config, make_vocab_size_divisible_by=s.make_vocab_size_divisible_by,
                                    use_transformer_engine=s.use_transformer_engine)
            load_hf_weights(stage, s.hf_path, spec=self.spec, layout=self.layout, padded_vocab_size=self.padded_vocab)
            for p in stage.parameters():
                p.requires_grad_(False)
            self._reference = stage.eval()
        return self._reference

    # ------------------------------------------------------------------ construction
    def _wrap_ddp(self, stage: torch.nn.Module) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.settings.optimizer.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=stage)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = model.no_sync
        return model

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
        )
        optimizer = get_megatron_optimizer(opt_config, [self.model])
        if s.dtype == "float16":
            self.config.grad_scale_func = optimizer.scale_loss
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(s.total_steps, 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(s.total_steps, 1), wd_incr_style="constant",
        )
        return optimizer, scheduler

    # ------------------------------------------------------------------ batching
    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """This DP rank's micro-batches; B is padded with masked copies of row 0 to fill them."""
        tokens = batch["tokens"]
        b, seq = tokens.shape
        dp, mbs = self.layout.dp_size, self.settings.micro_batch_size
        per_rank = -(-b // dp)
        mbs = min(mbs, per_rank)
        per_rank = -(-per_rank // mbs) * mbs
        pad = per_rank * dp - b
        padded = {}
        for key, value in batch.items():
            value = value.to(self.device)
            if pad:
                filler = value[:1].expand((pad,) + tuple(value.shape[1:])).clone()
                if key == "loss_mask":
                    filler.zero_()
                value = torch.cat([value, filler])
            padded[key] = value
        lo = self.layout.dp_rank * per_rank
        mine = {k: v[lo:lo + per_rank] for k, v in padded.items()}
        micro = [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, per_rank, mbs)]
        return micro, mbs, seq

    def _logprobs_of(self, output: torch.Tensor, tokens: torch.Tensor, *, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        from megatron.core import parallel_state as ps

        lp, ent = vocab_parallel_logprobs(
            output[:, :-1], tokens[:, 1:], vocab_size=self.spec.vocab_size, tp_rank=self.layout.tp_rank,
            tp_size=self.layout.tp_size, tp_group=ps.get_tensor_model_parallel_group(),
            temperature=temperature, with_entropy=with_entropy,
        )
        zero = lp.new_zeros(lp.shape[0], 1)
        lp = torch.cat([zero, lp], dim=1)
        if ent is not None:
            ent = torch.cat([zero, ent], dim=1)
        return lp, ent

    def _forward_step(self, loss_factory: Callable[[dict[str, torch.Tensor]], Callable[[torch.Tensor], Any]],
                      data: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        tokens = mb["tokens"]
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, positions, attention_mask=None)
        return output, loss_factory(mb)

    def _run(self, micro: list[dict[str, torch.Tensor]], mbs: int, seq: int, *, forward_only: bool,
             loss_factory: Callable[[dict[str, torch.Tensor]], Callable[[torch.Tensor], Any]],
             model: Optional[torch.nn.Module] = None) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_factory), data_iterator=iter(micro),
            model=[model if model is not None else self.model], num_microbatches=len(micro), seq_length=seq,
            micro_batch_size=mbs, forward_only=forward_only,
        )

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                         with_entropy: bool = False,
                         reference: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logprobs (and entropy) of `batch['tokens']`, [B, S] on every rank, forward only; of the
        frozen start checkpoint instead of the trained weights when `reference`."""
        b = batch["tokens"].shape[0]
        micro, mbs, seq = self._micro_batches({"tokens": batch["tokens"], "loss_mask": batch["tokens"] * 0})

        def factory(mb: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                lp, ent = self._logprobs_of(output, mb["tokens"], temperature=temperature, with_entropy=with_entropy)
                extra = {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}
                return lp.new_zeros(()), torch.tensor(1, dtype=torch.int), extra
            return loss_func

        store = self._run(micro, mbs, seq, forward_only=True, loss_factory=factory,
                          model=self._reference_model() if reference else None)
        keys = ["logprobs"] + (["entropy"] if with_entropy else [])
        out = []
        for key in keys:
            local = (torch.cat([d[key] for d in store]) if self.layout.is_last_stage
                     else torch.empty(len(micro) * mbs, seq, device=self.device))
            out.append(self._share(local)[:b].cpu())
        return out[0], (out[1] if with_entropy else None)

    @torch.no_grad()
    def compute_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, S, V] on every rank (vocab padding stripped). For checks only:
        it gathers the vocabulary across TP, which the training path never does."""
        from megatron.core import parallel_state as ps

        b = tokens.shape[0]
        micro, mbs, seq = self._micro_batches({"tokens": tokens, "loss_mask": tokens * 0})

        def factory(mb: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                parts = [torch.empty_like(output) for _ in range(self.layout.tp_size)]
                if self.layout.tp_size > 1:
                    dist.all_gather(parts, output.contiguous(), group=ps.get_tensor_model_parallel_group())
                else:
                    parts = [output]
                full = torch.cat(parts, dim=-1)[..., : self.spec.vocab_size].float()
                return full.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logits": full}
            return loss_func

        store = self._run(micro, mbs, seq, forward_only=True, loss_factory=factory)
        vocab = self.spec.vocab_size
        local = (torch.cat([d["logits"] for d in store]) if self.layout.is_last_stage
                 else torch.empty(len(micro) * mbs, seq, vocab, device=self.device))
        return self._share(local)[:b].cpu()

    def _share(self, local: torch.Tensor) -> torch.Tensor:
        """Last PP stage → every stage, then all DP slices → every rank."""
        from megatron.core import parallel_state as ps

        local = local.contiguous()
        if self.layout.pp_size > 1:
            dist.broadcast(local, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.layout.dp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.layout.dp_size)]
            dist.all_gather(parts, local, group=ps.get_data_parallel_group())
            local = torch.cat(parts)
        return local

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step on `batch`. Returns metrics (token-weighted means) on every rank."""
        micro, mbs, seq = self._micro_batches(batch)

        def factory(mb: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], Any]:
            def loss_func(output: torch.Tensor) -> Any:
                lp, ent = self._logprobs_of(output, mb["tokens"], temperature=temperature, with_entropy=with_entropy)
                loss_sum, denom, metrics = loss_fn(mb, lp, ent)
                report = {"loss_sum": loss_sum.detach().float(), "denominator": denom.detach().float()}
                for k, v in metrics.items():  # weight by the micro-batch's denominator
                    report[k] = v.detach().float() * denom.detach().float()
                return loss_sum, denom.to(torch.int), report
            return loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run(micro, mbs, seq, forward_only=False, loss_factory=factory)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        update_ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(store, grad_norm=grad_norm, update_ok=update_ok)
        metrics["lr"] = lr
        return metrics

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
        export_hf(self.model, out_dir, spec=self.spec, layout=self.layout, source_dir=self.settings.hf_path)
