"""``Pipeline``: runs one training step of a model split into stages over the ranks of a pipeline mesh,
in the action order of a schedule (``torchdist_ext.pipeline.schedule``).

    pipe = Pipeline({stage: module, ...}, pp_mesh=mesh["pp"], schedule="zb-h1", num_microbatches=8,
                    loss_fn=loss_fn)
    loss = pipe.step(inputs, targets)   # every rank: the mean loss; the gradients are in each module's .grad

Each rank passes the same ``inputs`` / ``targets`` (only the first stage reads the inputs and only the last
the targets), split along dim 0 into ``num_microbatches`` equal micro-batches. The loss is
``mean_i loss_fn(last_stage(...(inputs_i)), targets_i)``, so with a mean-reducing ``loss_fn`` the gradients
equal those of ``loss_fn(model(inputs), targets)`` in one process.

Between stages on different ranks activations (forward) and their gradients (backward) travel as
point-to-point messages on the pipeline group: a small header (shape and dtype) and the data, two tags per
(direction, stage, micro-batch); sends are asynchronous, and the receive of the next action's input is posted
before the current action runs, so it arrives while this rank computes. A send's buffer is released as soon
as a message from its peer shows that the peer has received it (the peer sent that message from a later
action than the one that consumed ours), not at the end of the step: a stage's outputs and input gradients
would otherwise stay alive for all the step's micro-batches. A stage's output tensor itself gives up its
storage once sent (its backward needs only its ``grad_fn``; Megatron-LM's ``deallocate_output_tensor``): code
that keeps a reference to the very tensor a stage module returns (a forward hook, a module attribute, an op
of the stage that saved it as an input) sees an empty tensor after the send: compute from it inside the
stage. Between stages on the same rank (zb-v's turn) they are handed over in memory.

Under zb-h1 and zb-v the stages' linears run in split mode (``torchdist_ext.weight_grad``): B
computes input gradients only and queues the weight gradients, which the W actions run. ``timeline`` holds
the last step's actions with their wall-clock start and end on this rank, and the bytes of live tensors
right after each (``torchdist_ext.cpu_memory``'s count once ``track()`` has run; else None): their largest is
the step's peak between passes, what the planner's activation model counts (``peak_held_activations``),
without the transients inside a pass.

A stage module sharded with FSDP2 (``fully_shard`` over the data-parallel ranks of that stage) all-gathers
its parameters once per step, at its first forward, and keeps them unsharded through the step's
micro-batches (as torchtitan does under pipeline parallelism; resharding after each forward would gather
them again for each later backward and forward), accumulates its unsharded gradients and reduce-scatters
them once, right after the stage's last B or W of the step (not at the end of the step), as torch's
pipelining does: FSDP2's resharding and gradient sync are off during the step and its post-backward runs
then, which reshards; after the step the stage reshards after each forward again (FSDP2's default). The stage module itself must be the
``fully_shard`` root of its sharded blocks.

The messages go over gloo (CPU tensors) for now: NCCL matches point-to-point messages in the order they are
posted per peer and blocks a peer's later sends behind a posted receive, which this runtime's early
receives would deadlock; batched exchanges per action (``batch_isend_irecv``) are the way there.
"""

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torch.distributed.fsdp import FSDPModule, fully_shard

from torchdist_ext import cpu_memory
from torchdist_ext.weight_grad import SplitLinear, WeightGradStore, give_weight_grad_slot
from torchdist_ext.pipeline.schedule import (
    Action,
    every_rank_actions,
    num_stages,
    rank_of_stage,
    splits_weight_grad,
    stages_of_rank,
)

__all__ = ["Pipeline", "TimedAction", "enable_weight_grad_split"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 6
_FORWARD, _BACKWARD = 0, 1
_PASS_OF = ("F", "B")  # the pass that sends, and the one that receives, a message of each direction


class TimedAction(NamedTuple):
    kind: str
    stage: int
    microbatch: int
    start: float  # wall-clock seconds (time.time), comparable across the ranks of one machine
    end: float
    live_bytes: int | None = None  # live tensor bytes on the device right after the action, where counted


class _PendingSend(NamedTuple):
    work: dist.Work
    message: Tensor  # kept alive until the send completes
    peer: int
    consumer: int  # the position of the peer's action that receives it


def _live_bytes_counter(device: torch.device) -> Callable[[], int] | None:
    """What counts the bytes of live tensors on ``device``: ``torchdist_ext.cpu_memory`` once tracking (the
    messages go over gloo, so the stages run on the CPU for now), else None."""
    if device.type == "cpu" and cpu_memory.tracking():
        return cpu_memory.memory_allocated
    return None


def enable_weight_grad_split(module: nn.Module) -> nn.Module:
    """Puts ``module``'s linears in split mode, in place: our tensor-parallel linears get
    ``split_weight_grad = True``; every plain ``nn.Linear`` becomes a ``SplitLinear`` (the same object, its
    class changed: FSDP2, optimizers and hooks keep seeing the same module and parameters; a linear that is
    itself ``fully_shard``-ed keeps its whole backward in B). Returns ``module``."""
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = SplitLinear
            give_weight_grad_slot(child)
        elif hasattr(child, "split_weight_grad"):
            child.split_weight_grad = True
    return module


class Pipeline:
    """One pipeline rank's stages and its schedule (see the module docstring).

    Args:
        stages: ``{stage index: module}`` for the stages this rank holds (``stages_of_rank``).
        pp_mesh: 1-D DeviceMesh of the pipeline ranks (rank d of the mesh is pipeline rank d).
        schedule: one of ``SCHEDULES``.
        num_microbatches: micro-batches per step (interleaved-1f1b: divisible by pp).
        loss_fn: ``loss_fn(output, targets) -> scalar`` of the last stage's output of a micro-batch.
        virtual_stages: chunks per rank for interleaved-1f1b.
    """

    def __init__(self, stages: Mapping[int, nn.Module], *, pp_mesh: DeviceMesh, schedule: str,
                 num_microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], virtual_stages: int = 1):
        if not isinstance(pp_mesh, DeviceMesh) or pp_mesh.ndim != 1:
            raise TypeError(f"pp_mesh must be a 1-D DeviceMesh, got {pp_mesh!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, targets) -> loss, got {type(loss_fn).__name__}")
        self.pp, self.rank = pp_mesh.size(), pp_mesh.get_local_rank()
        self.schedule, self.virtual_stages, self.num_microbatches = schedule, virtual_stages, num_microbatches
        self.num_stages = num_stages(schedule, self.pp, virtual_stages)
        every_rank = every_rank_actions(schedule, self.pp, num_microbatches, virtual_stages)
        self.actions = every_rank[self.rank]
        # Each action's position in its rank's order, every rank's: when a message from a peer arrives, the
        # peer has received every message of ours that the action sending it, or an earlier one, consumed.
        self._position = {(a.kind, a.stage, a.microbatch): i for actions in every_rank for i, a in enumerate(actions)}
        expected = stages_of_rank(schedule, self.pp, self.rank, virtual_stages)
        if not isinstance(stages, Mapping) or sorted(stages) != sorted(expected):
            got = sorted(stages) if isinstance(stages, Mapping) else type(stages).__name__
            raise ValueError(f"stages must map this rank's stage indices {expected} ({schedule}, pp={self.pp}, "
                             f"rank {self.rank}) to modules, got {got}")
        for index, module in stages.items():
            if not isinstance(module, nn.Module):
                raise TypeError(f"stages[{index}] must be an nn.Module, got {type(module).__name__}")
            if not isinstance(module, FSDPModule) and any(isinstance(m, FSDPModule) for m in module.modules()):
                raise ValueError(f"stages[{index}] holds fully_shard-ed modules but is not itself fully_shard-ed: "
                                 f"call fully_shard on the stage module too (its root), so that its gradients are "
                                 f"reduced once per step, after its last backward pass")
        self.split = splits_weight_grad(schedule)
        self.stages = {i: enable_weight_grad_split(m) if self.split else m for i, m in stages.items()}
        self.group = pp_mesh.get_group()
        self.loss_fn = loss_fn
        self.weight_grads = WeightGradStore()
        self.timeline: list[TimedAction] = []
        # The position of each stage's last gradient action (B, or W under a split): its FSDP2 reduction.
        self._last_grad_action = {a.stage: i for i, a in enumerate(self.actions) if a.kind in "BW"}

    # -- messages ------------------------------------------------------------------------------------------

    def _tag(self, direction: int, stage: int, microbatch: int) -> int:
        """Two tags per message (header, data), unique per direction, receiving stage and micro-batch."""
        return 2 * ((direction * self.num_stages + stage) * self.num_microbatches + microbatch)

    def _send(self, tensor: Tensor, direction: int, to_stage: int, microbatch: int) -> None:
        if rank_of_stage(self.schedule, self.pp, to_stage, self.virtual_stages) == self.rank:
            self._in_memory[(direction, to_stage, microbatch)] = tensor
            return
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"a pipeline stage's output must have at most {_MAX_DIMS} dims and a dtype in "
                             f"{_DTYPES}, got shape {tuple(tensor.shape)} and {tensor.dtype}")
        header = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        peer = rank_of_stage(self.schedule, self.pp, to_stage, self.virtual_stages)
        tag = self._tag(direction, to_stage, microbatch)
        data = tensor.contiguous()
        consumer = self._position[(_PASS_OF[direction], to_stage, microbatch)]
        for message, message_tag in ((header.to(data.device), tag), (data, tag + 1)):
            work = dist.isend(message, group=self.group, group_dst=peer, tag=message_tag)
            self._sends.append(_PendingSend(work, message, peer, consumer))

    def _release_sends(self, peer: int, before: int) -> None:
        """Waits for (at once: they were received) and drops the sends to ``peer`` that its actions up to
        position ``before`` consumed (each received its input before it ran), so that their buffers (a stage's
        outputs, its input gradients) are freed now rather than at the end of the step."""
        pending = []
        for send in self._sends:
            if send.peer == peer and send.consumer <= before:
                send.work.wait()
            else:
                pending.append(send)
        self._sends = pending

    def _post_receive(self, direction: int, stage: int, microbatch: int, from_stage: int) -> None:
        """Posts the header's receive of a message ``stage`` will need (no-op for an in-memory handover)."""
        key = (direction, stage, microbatch)
        peer = rank_of_stage(self.schedule, self.pp, from_stage, self.virtual_stages)
        if peer == self.rank or key in self._receives:
            return
        tag = self._tag(direction, stage, microbatch)
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        posted = [dist.irecv(header, group=self.group, group_src=peer, tag=tag), header]
        # The micro-batches of a step share their shapes: once one arrived, the data's receive is posted too.
        if (layout := self._layouts.get((direction, stage))) is not None:
            data = torch.empty(layout[0], dtype=layout[1], device=self.device)
            posted += [dist.irecv(data, group=self.group, group_src=peer, tag=tag + 1), data]
        self._receives[key] = (peer, posted)

    def _receive(self, direction: int, stage: int, microbatch: int, from_stage: int) -> Tensor:
        key = (direction, stage, microbatch)
        if key in self._in_memory:
            return self._in_memory.pop(key)
        self._post_receive(direction, stage, microbatch, from_stage)
        peer, posted = self._receives.pop(key)
        posted[0].wait()
        header = posted[1].tolist()
        layout = (header[2:2 + header[0]], _DTYPES[header[1]])
        what = "activation" if direction == _FORWARD else "gradient"
        if len(posted) == 2:
            self._layouts[(direction, stage)] = layout
            data = torch.empty(layout[0], dtype=layout[1], device=self.device)
            dist.recv(data, group=self.group, group_src=peer, tag=self._tag(direction, stage, microbatch) + 1)
        else:
            expected = self._layouts[(direction, stage)]
            if layout != expected:
                raise ValueError(f"stage {stage}'s input {what} of micro-batch {microbatch} has shape {layout[0]} "
                                 f"and dtype {layout[1]}, but earlier micro-batches' had {expected[0]} and "
                                 f"{expected[1]}: every micro-batch must give the stages the same shapes")
            posted[2].wait()
            data = posted[3]
        self._release_sends(peer, before=self._position[(_PASS_OF[direction], from_stage, microbatch)])
        return data

    def _input_source(self, action: Action) -> tuple[int, int, int, int] | None:
        """(direction, stage, micro-batch, from stage) of the message an action waits for, or None."""
        if action.kind == "F" and action.stage > 0:
            return _FORWARD, action.stage, action.microbatch, action.stage - 1
        if action.kind == "B" and action.stage < self.num_stages - 1:
            return _BACKWARD, action.stage, action.microbatch, action.stage + 1
        return None

    # -- actions -------------------------------------------------------------------------------------------

    def _forward(self, stage: int, microbatch: int, received: Tensor | None) -> None:
        if stage == 0:
            x = self._inputs[microbatch]
        else:
            x = received.detach()
            x.requires_grad_(x.is_floating_point())
        out = self.stages[stage](x)
        if stage == self.num_stages - 1:
            loss = self.loss_fn(out, self._targets[microbatch]) / self.num_microbatches
            self._losses.append(loss.detach())
            self._saved[(stage, microbatch)] = (x, loss)
        else:
            self._saved[(stage, microbatch)] = (x, out)
            self._send(out.detach(), _FORWARD, stage + 1, microbatch)
            _release_storage(out)

    def _backward(self, stage: int, microbatch: int, grad: Tensor | None) -> None:
        x, out = self._saved.pop((stage, microbatch))
        collecting = self.weight_grads.collecting((stage, microbatch)) if self.split else nullcontext()
        with collecting:
            if grad is None:  # the last stage: out is the loss
                torch.autograd.backward(out)
            else:  # out's storage may be released: its gradient edge (grad_fn) and metadata are what count
                torch.autograd.backward(torch.autograd.graph.get_gradient_edge(out), grad)
        if stage > 0:
            self._send(x.grad, _BACKWARD, stage - 1, microbatch)

    def step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One training step (forward and backward of every micro-batch; no optimizer step): returns the
        mean loss (0-d, the same on every rank) and leaves the gradients in the stages' parameters."""
        for name, t in (("inputs", inputs), ("targets", targets)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
            if t.dim() == 0 or t.shape[0] % self.num_microbatches:
                raise ValueError(f"{name}.size(0) must be divisible by num_microbatches={self.num_microbatches}, "
                                 f"got shape {tuple(t.shape)}")
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor: the pipeline's messages go over gloo for now (see "
                                 f"the module docstring), got one on {t.device}")
        self.device = inputs.device
        self._inputs, self._targets = inputs.chunk(self.num_microbatches), targets.chunk(self.num_microbatches)
        self._saved, self._in_memory, self._receives, self._sends, self._losses = {}, {}, {}, [], []
        self._layouts = {}  # (direction, stage) -> (shape, dtype) of its incoming messages this step
        self.timeline = []
        self.weight_grads.clear()  # nothing left over from a step that raised
        run = {"F": self._forward, "B": self._backward, "W": lambda s, i, _: self.weight_grads.run((s, i))}
        live_bytes = _live_bytes_counter(self.device)
        for module in self.stages.values():
            if isinstance(module, FSDPModule):  # accumulate over the micro-batches; reduce once (below)
                module.set_requires_gradient_sync(False)
                module.set_reshard_after_forward(False)
                module.set_reshard_after_backward(False)
                module.set_is_last_backward(False)
        for position, action in enumerate(self.actions):
            source = self._input_source(action)
            received = self._receive(*source) if source else None  # waiting for it is idle time, not the action's
            if position + 1 < len(self.actions) and (upcoming := self._input_source(self.actions[position + 1])):
                self._post_receive(*upcoming)
            start = time.time()
            run[action.kind](action.stage, action.microbatch, received)
            self.timeline.append(TimedAction(action.kind, action.stage, action.microbatch, start, time.time(),
                                             live_bytes() if live_bytes is not None else None))
            if position == self._last_grad_action[action.stage] and isinstance(self.stages[action.stage], FSDPModule):
                _reduce_fsdp_gradients(self.stages[action.stage])
        for send in self._sends:
            send.work.wait()
        losses = [loss.float() for loss in self._losses]  # fp32 on every rank, whatever the logits' dtype
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # the last stage's rank holds the sum; the others add 0
        self._inputs = self._targets = self._saved = self._sends = None
        return loss


def _release_storage(out: Tensor) -> None:
    """Frees a stage output's storage once nothing else holds it (the send of it, or the in-memory handover
    to the next stage on this rank, keeps an alias until done): its backward needs only its ``grad_fn``, so
    each micro-batch in flight does not keep one more [batch, seq, hidden] (Megatron-LM's
    ``deallocate_output_tensor``). A view, or an output without a ``grad_fn``, is left as it is."""
    if out._base is None and out.grad_fn is not None:
        out.data = torch.empty((0,), dtype=out.dtype, device=out.device)


def _reduce_fsdp_gradients(module: FSDPModule) -> None:
    """FSDP2's post-backward for a stage whose backward passes of the step are all done: reduce-scatter
    the accumulated gradients and reshard. FSDP2 has no public call for it; this is what
    ``torch.distributed.pipelining``'s ``perform_reduce_grad`` does."""
    module.set_is_last_backward(True)
    module.set_reshard_after_forward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
