"""The planted bugs: each a few (file, old, new) replacements in ``src/``, the old text required exactly once.

Each is a slip an engineer could make (an off-by-one, a missing division, the wrong flag read), and each has a
demonstration program (``demos.py``) on which it trains differently from DDP + the plain optimizer, raising nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    path: str  # relative to src/
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    feature: str  # the mode or feature it breaks
    slip: str  # what the engineer got wrong
    edits: tuple[Edit, ...]


def _one(name: str, feature: str, slip: str, path: str, old: str, new: str) -> Mutant:
    return Mutant(name, feature, slip, (Edit(path, old, new),))


MUTANTS: tuple[Mutant, ...] = (
    _one(
        "zero1_staged_edge",
        "ZeRO-1 under DDP, staged parameter sync (bucket_view=False)",
        "each owner's slice of the stage broadcast one element short: the element at its edge keeps the stage's "
        "old value on the other ranks",
        "distoptim/zero/buckets.py",
        "work.slices = [(chunk.src, chunk.start, chunk.end) for chunk in round_.chunks]",
        "work.slices = [(chunk.src, chunk.start, chunk.end - 1) for chunk in round_.chunks]",
    ),
    _one(
        "even_floor_chunk",
        "partition='even' (ZeRO-1, ZeRO-2, ShardedDataParallel)",
        "a region's share per rank rounded down, not up: the region's last elements are owned by no rank",
        "distoptim/zero/partition.py",
        "            chunk = -(-sum(numels[i] for i in region) // world_size)  # ceil",
        "            chunk = sum(numels[i] for i in region) // world_size  # ceil",
    ),
    _one(
        "bucket_view_first_region",
        "ZeRO-1 with parameters_as_bucket_view=True, grown by add_param_group / unfreezing (even partition)",
        "only a layout's first region gathered: the regions a grown plan appends are never synced",
        "distoptim/zero/buckets.py",
        "            comm.gather_from_owners(buffer, layout.bounds, self.group, self.collectives)\n",
        "            comm.gather_from_owners(buffer, layout.bounds[:1], self.group, self.collectives)\n",
    ),
    _one(
        "clip_local_norm",
        "clip_grad_norm_ (every mode that clips)",
        "the norm of this rank's owned shard, never summed over the ranks",
        "distoptim/zero/clipping.py",
        "    total = comm.all_reduce_(local, group, op)\n",
        "    total = local\n",
    ),
    _one(
        "clip_unclamped",
        "clip_grad_norm_ (every mode that clips)",
        "the clip coefficient not capped at 1: a gradient whose norm is under max_norm is scaled up to it",
        "distoptim/zero/clipping.py",
        "    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)\n",
        "    coefficient = max_norm / (total + 1e-6)\n",
    ),
    _one(
        "zero2_hybrid_div",
        "the deprecated reduce_to_owners_hook under hybrid sharding (replicate_group)",
        "divided by the shard group's size only: replicas summed, not averaged",
        "distoptim/ddp/reduce_to_owners.py",
        "    buffer.div_(zero.world_size * zero.replica_count)\n",
        "    buffer.div_(zero.world_size)\n",
    ),
    _one(
        "sdp_land_copy",
        "ShardedDataParallel: accumulating micro-batches",
        "each landing copies into the owned gradient instead of adding after the first: accumulation lost",
        "distoptim/sharded_data_parallel/gradients.py",
        "target.add_(buffer[start:end]) if self.landed[bucket] else target.copy_(buffer[start:end])",
        "target.copy_(buffer[start:end])",
    ),
    _one(
        "sdp_unfreeze_no_div",
        "ShardedDataParallel: a parameter unfrozen since the plan (all-reduced at the end of the backward)",
        "the gradient of an unplaced parameter not scaled by 1/N before it is all-reduced",
        "distoptim/sharded_data_parallel/unplaced.py",
        "            grad.mul_(1.0 / (zero.world_size * zero.replica_count))",
        "            grad.mul_(1.0)",
    ),
    _one(
        "overlap_hook_unused",
        "hook_with_zero_step (overlap_with_ddp)",
        "the used-parameter flags ignored: a parameter no rank used is stepped on a zero gradient",
        "distoptim/ddp/zero_step.py",
        "        used = _UsedFlags(params, ddp).wait() if _finds_unused(ddp) else [True] * len(params)",
        "        used = [True] * len(params)",
    ),
    _one(
        "interleaved_unused",
        "hook_with_zero_step_interleaved",
        "the bucket's used flags not waited for: unused parameters stepped on a zero gradient",
        "distoptim/ddp/zero_step.py",
        "        stepper.step(reduction.grads(None if reduction.used is None else reduction.used.wait()))",
        "        stepper.step(reduction.grads(None))",
    ),
    _one(
        "overlap_row_major_grad",
        "the overlap hooks with a parameter that is not row-major in memory (transposed, channels_last)",
        "a parameter's gradient read from DDP's bucket as if contiguous (row-major), where DDP lays it out with "
        "the parameter's strides",
        "distoptim/ddp/zero_step.py",
        "grads[param] = view_like(reduced, offset, param) if param_used else None",
        "grads[param] = reduced[offset : offset + param.numel()].view(param.shape) if param_used else None",
    ),
    _one(
        "master_reseed_all",
        "master weights (bf16 + master_dtype)",
        "a master copy re-seeded only where every element of its piece was written (all, not any): a clamp of "
        "some elements is overwritten by the stale master at the next step",
        "distoptim/zero/shard.py",
        "written = torch.ne(_bits(into), _bits(master.to(into.dtype))).any()",
        "written = torch.ne(_bits(into), _bits(master.to(into.dtype))).all()",
    ),
    _one(
        "scaler_double_unscale",
        "GradScaler after scaler.unscale_(zero) (to clip)",
        "the already-unscaled stage not read: gradients unscaled a second time at the step",
        "distoptim/zero/amp.py",
        '    unscaled = _scaler_state(grad_scaler, optimizer)["stage"].name == "UNSCALED"\n',
        "    unscaled = False\n",
    ),
    _one(
        "ckpt_consolidated_group_lr",
        "consolidated checkpoints (load_state_dict)",
        "every group loads the first saved group's hyperparameters (its lr among them)",
        "distoptim/checkpoint/consolidated.py",
        "    return by_param, [loaded_hyperparameters(saved) for saved in saved_groups]\n",
        "    return by_param, [loaded_hyperparameters(saved_groups[0]) for saved in saved_groups]\n",
    ),
    _one(
        "ckpt_sharded_single_key",
        "sharded checkpoints (distoptim.checkpoint: resume, reshard)",
        "a loaded entry kept only when it holds more than one key (a step count and more): SGD's momentum buffer, "
        "alone in its entry, is dropped at every sharded load",
        "distoptim/checkpoint/dcp_state.py",
        "        if entry:\n            state[local.tensor] = entry\n",
        "        if len(entry) > 1:\n            state[local.tensor] = entry\n",
    ),
    _one(
        "adafactor_cut",
        "Adafactor / Muon whole-tensor ownership under partition='even'",
        "only Muon is kept whole: Adafactor's matrices are cut across ranks and factored per piece",
        "distoptim/zero/local_optimizer.py",
        "            whole.append(not is_elementwise(cls))\n",
        "            whole.append(issubclass(cls, torch.optim.Muon))\n",
    ),
    # --- review R-42: mutants planted by the acceptance check (not the fuzzer's authors)
    _one(
        "clip_inf_summed",
        "clip_grad_norm_(norm_type=inf) (every mode that clips)",
        "the inf-norm's per-rank maxima summed over the ranks, not max-reduced (the inf case forgotten)",
        "distoptim/zero/clipping.py",
        'op = "max" if norm_type == math.inf else "min" if norm_type == -math.inf else "sum"',
        'op = "min" if norm_type == -math.inf else "sum"',
    ),
    _one(
        "overlap_lr_stale",
        "the overlap hooks (overlap_with_ddp) with a scheduler or an lr edit",
        "the functional optimizers keep the hyperparameters they were built with: param_groups edits never pushed",
        "distoptim/zero/overlap.py",
        "            functional.param_group.update((k, group[k]) for k in functional.defaults if k in group)\n",
        "",
    ),
    _one(
        "overlap_adamw_coupled",
        "the overlap hooks with AdamW (functional kernel)",
        "AdamW's kernel spec without decoupled_weight_decay=True: L2 weight decay added to the gradient, as Adam's",
        "distoptim/functional/kernels.py",
        '    defaults={**_ADAM_DEFAULTS, "weight_decay": 1e-2},\n    fixed={"decoupled_weight_decay": True},\n',
        '    defaults={**_ADAM_DEFAULTS, "weight_decay": 1e-2},\n',
    ),
    _one(
        "scaler_local_verdict",
        "GradScaler with an overflow only some ranks' owned gradient holds",
        "the scaler handed this rank's own inf verdict, not the agreed one: only the owner backs its scale off",
        "distoptim/zero/amp.py",
        "        self.flag.fill_(float(found_anywhere))\n",
        "        self.flag.fill_(float(self.found_here))\n",
    ),
    _one(
        "stitch_row_major",
        "consolidated state of a fragment of a parameter not stored row-major (even partition)",
        "the whole-parameter state made row-major (torch.empty(shape)), its pieces written in the parameter's "
        "memory order",
        "distoptim/zero/shard.py",
        "                whole[name] = torch.empty_like(param, dtype=value.dtype, device=value.device)\n",
        "                whole[name] = torch.empty(param.shape, dtype=value.dtype, device=value.device)\n",
    ),
    _one(
        "master_reseed_always",
        "master weights (bf16 + master_dtype), every mode that steps through ZeroRedundancyOptimizer.step",
        "every master copy re-seeded from its rounded bf16 parameter before each step (the written-test dropped): "
        "master weights in name only, updates below half a bf16 ulp are lost",
        "distoptim/zero/shard.py",
        "                torch.where(written, into, master, out=master)\n",
        "                master.copy_(into)\n",
    ),
    _one(
        "sdp_hybrid_div",
        "ShardedDataParallel under hybrid sharding (replicate_group)",
        "each bucket divided by the shard group's size only: the replicas' gradients summed, not averaged",
        "distoptim/sharded_data_parallel/gradients.py",
        "        scale = 1.0 / (self.zero.world_size * self.zero.replica_count)",
        "        scale = 1.0 / self.zero.world_size",
    ),
    _one(
        "sdp_clear_forgets_held",
        "ShardedDataParallel: zero_grad(set_to_none=False), then a backward that does not use a parameter",
        "a clear that zeroes also forgets which parameters hold a gradient: a zeroed, unused parameter is skipped "
        "at the step, where torch.optim steps it on zeros (momentum, weight decay still move it)",
        "distoptim/sharded_data_parallel/gradients.py",
        "        if set_to_none:\n            self.holds = [False] * len(self.params)\n",
        "        self.holds = [False] * len(self.params)\n        if set_to_none:\n",
    ),
)

MUTANTS += (  # issue 43: the state formats
    _one(
        "format_on_shard_size",
        "state_format bf16/int8 under partition='even' (every mode)",
        "a tensor's state format decided on this rank's piece, not on the whole parameter (the bug of torchao "
        "under FSDP2, pytorch/ao#4912): a parameter cut in pieces below the threshold keeps fp32 state",
        "distoptim/zero/state_formats.py",
        "            piece.tensor: tensor_format(piece.param, group_format(group))",
        "            piece.tensor: tensor_format(piece.tensor, group_format(group))",
    ),
    _one(
        "int8_cut_inside_block",
        "state_format='int8' under partition='even'",
        "the even partition no longer told to cut at quantization blocks: a rank's blocks start at its piece, not "
        "at the parameter's element 0, so the scales cover other elements than one process's",
        "distoptim/zero/state_formats.py",
        '        codecs.BLOCK if tensor_format(p, group_format(group)) == "int8" else 1',
        "        1",
    ),
    _one(
        "overlap_format_new_state_plain",
        "state_format bf16/int8 under the overlap hooks",
        "only tensors that already had state are encoded after a bucket's step: a first step's new state stays "
        "fp32 until the next step, which starts from unrounded moments",
        "distoptim/zero/overlap.py",
        "                tensors = [local.tensor for local, grad in zip(part.locals, step_grads) if grad is not None]",
        "                tensors = [\n                    local.tensor\n"
        "                    for local, grad in zip(part.locals, step_grads)\n"
        "                    if grad is not None and local.tensor in state\n                ]",
    ),
)

MUTANTS += (  # issue 42's third review: a bug on the elements whose gradient is near zero
    _one(
        "bf16_grad_flush",
        "a bf16 layer (every mode that steps through ZeRO's shards)",
        "a bf16 gradient piece passed through fp16 with denormals flushed: elements below 2^-14 step as zero "
        "(RMSprop's first step moves them 10 lr on the oracle, nothing here; every layer below follows)",
        "distoptim/zero/shard.py",
        "        piece = self.grad_from(grad)\n",
        "        piece = self.grad_from(grad)\n"
        "        if piece is not None and piece.dtype == torch.bfloat16:\n"
        "            piece = torch.where(piece.abs() < 2**-14, torch.zeros_like(piece), piece)\n",
    ),
)

_UPDATE = "            group.update(saved)\n"
_KEEP_LR = "            group.update({k: v for k, v in saved.items() if k in ('lr', 'initial_lr')})\n"
_OVERLAP_STEP = "functional.param_group.update((k, group[k]) for k in functional.defaults if k in group)"

MUTANTS += (  # review r-42d (its A, E, K, G4): settings a load or an edit must carry, a crash in the forward
    Mutant(
        "load_keeps_constructor_hyperparameters",
        "load_state_dict / load_sharded_state_dict (every mode)",
        "a load takes only lr from the checkpoint: betas, momentum, nesterov... stay the constructor's",
        (
            Edit(
                "distoptim/zero/state_dicts.py",
                "        for group, saved in zip(self.param_groups, hyperparameters):\n" + _UPDATE,
                "        for group, saved in zip(self.param_groups, hyperparameters):\n" + _KEEP_LR,
            ),
            Edit(
                "distoptim/zero/state_dicts.py",
                "        for group, saved in zip(self.param_groups, saved_groups):\n" + _UPDATE,
                "        for group, saved in zip(self.param_groups, saved_groups):\n" + _KEEP_LR,
            ),
        ),
    ),
    _one(
        "edited_hyperparameter_not_pushed",
        "a hyperparameter other than lr edited between steps (every mode but the overlap hooks)",
        "only lr (and keys the local optimizer lacks) pushed into the local optimizer after construction",
        "distoptim/zero/shard.py",
        "        target.update((k, v) for k, v in source.items() if k not in GLOBAL_ONLY)\n",
        "        target.update((k, v) for k, v in source.items() if k not in GLOBAL_ONLY"
        " and (k in ('lr', 'initial_lr') or k not in target))\n",
    ),
    Mutant(
        "overlap_drops_nesterov",
        "the overlap hooks, SGD with nesterov=True",
        "the overlap step's functional optimizer never given nesterov: plain momentum",
        (
            Edit(
                "distoptim/zero/overlap.py",
                _OVERLAP_STEP,
                _OVERLAP_STEP.replace("if k in group)", "if k in group and k != 'nesterov')"),
            ),
            Edit(
                "distoptim/zero/overlap.py",
                "for k, v in group.items() if k in defaults}",
                "for k, v in group.items() if k in defaults and k != 'nesterov'}",
            ),
        ),
    ),
    _one(
        "bf16_bucket_view_flat",
        "parameters_as_bucket_view=True with a bf16 layer",
        "a bf16 parameter's bucket view left 1-D: the subject's forward raises inside torch (in the fuzzer's "
        "models.py, which the verdict once read as the oracle's error, a pass)",
        "distoptim/zero/buckets.py",
        "            param.data = view  # its old storage is freed here, unless something else holds it\n",
        "            param.data = view.reshape(-1) if param.dtype == torch.bfloat16 and param.dim() > 1 else view\n",
    ),
)

MUTANTS += (  # issue 45: ShardedDataParallel's used flags summed as DDP's used map, not agreed
    _one(
        "sdp_flags_local",
        "ShardedDataParallel: a parameter some ranks use and others do not",
        "each rank takes its own used flags for the ranks' sums: a rank owning a piece of a parameter only another "
        "rank used never steps it",
        "distoptim/sharded_data_parallel/gradients.py",
        "            self.agreed([count > 0 for count in counts[:-1]], backward=True)",
        "            self.agreed(list(self.used), backward=True)",
    ),
    _one(
        "sdp_flags_late_ignored",
        "ShardedDataParallel: a parameter unfrozen since the plan (all-reduced at the end of the backward)",
        "the flag saying some rank holds parameters trainable since the plan ignored: their gradients are never "
        "averaged",
        "distoptim/sharded_data_parallel/gradients.py",
        "counts is not None and not counts[-1]:",
        "counts is not None:",
    ),
)

MUTANTS += (  # the bug a review found that no program reached (fixed in 2ad6c3c): the fuzzer grows models there now
    _one(
        "sdp_replan_leaves_no_sync",
        "ShardedDataParallel: a group added (or a layer placed) between two backwards inside no_sync()",
        "the re-placement builds the store afresh with no_sync off: the rest of the context reduces each backward, "
        "and its forwards broadcast buffers DDP's skip",
        "distoptim/sharded_data_parallel/gradients.py",
        "        self.no_sync = previous.no_sync  # placed inside no_sync() (add_param_group): its backwards still "
        "accumulate\n",
        "",
    ),
)

MUTANTS += (  # ShardedDataParallel(static_graph=True), drawn since the eleventh stream (program._static_graph)
    _one(
        "sdp_static_flags_local",
        "ShardedDataParallel(static_graph=True): a parameter some ranks use and others do not",
        "a predicted backward (after the first) taken as agreed on this rank's own used flags, as if every rank used "
        "the same parameters: a rank owning a piece of a parameter only another rank used steps without it",
        "distoptim/sharded_data_parallel/gradients.py",
        "            self.holds = [held or static.used(index) for index, held in enumerate(self.holds)]",
        "            self.holds, self.unagreed = [held or now for held, now in zip(self.holds, self.used)], False",
    ),
)

BY_NAME = {m.name: m for m in MUTANTS}
