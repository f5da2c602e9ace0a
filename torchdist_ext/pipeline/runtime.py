"""``Pipeline``: runs one training step of a model split into stages over the ranks of a pipeline mesh, in the
action order of a schedule (``torchdist_ext.pipeline.schedule``), with activations and their gradients sent
between the ranks as point-to-point messages in ``torchdist_ext.pipeline.messages``' order.

    pipe = Pipeline({stage: module, ...}, pp_mesh=mesh["pp"], schedule="zb-h1", num_microbatches=8,
                    loss_fn=loss_fn)
    loss = pipe.step(inputs, targets)   # every rank: the mean loss; the gradients are in each module's .grad

Why messages, buffers and FSDP2 stages are handled this way: docs/architecture.md, "Pipeline parallelism".
"""

import builtins
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
from torchdist_ext.agreement import check_agreement
from torchdist_ext.pipeline.messages import BACKWARD, FORWARD, PostedOp, message_plan
from torchdist_ext._weight_grad import SplitLinear, WeightGradStore, give_weight_grad_slot
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
_FAILED = -1  # a header's number of dims announcing that the sender's step failed, instead of a message
_PASS_OF = ("F", "B")  # the pass that sends, and the one that receives, a message of each direction


class TimedAction(NamedTuple):
    """One action of ``Pipeline.timeline``: what this rank ran in the last step, and when.

    Args:
        kind: ``"F"``, ``"B"`` or ``"W"``.
        stage: the stage the action ran.
        microbatch: the micro-batch it ran.
        start: wall-clock seconds (``time.time``) at its start, comparable across the ranks of one machine; on
            CUDA from events on the stream, so the GPU's time, not the host's.
        end: wall-clock seconds once the messages it made are posted (gloo writes a message whose receive is
            posted in the sending thread: the rank's work, not idle time); a wait for a message header that
            follows is not counted.
        live_bytes: bytes of live tensors on the device right after the action (CUDA's caching allocator, or
            ``torchdist_ext.cpu_memory``'s once ``track()`` has run; else None). Their largest over the step is
            its peak between passes, what the planner's activation model counts (``peak_held_activations``),
            without the transients inside a pass.
    """

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    live_bytes: int | None = None


class _PendingSend(NamedTuple):
    work: dist.Work
    message: Tensor  # kept alive until the send completes
    peer: int
    consumer: int  # the position of the peer's action that receives it


def _live_bytes_counter(device: torch.device) -> Callable[[], int] | None:
    """What counts the bytes of live tensors on ``device``: CUDA's caching allocator, or on the CPU
    ``torchdist_ext.cpu_memory`` once tracking (else None)."""
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    if device.type == "cpu" and cpu_memory.tracking():
        return cpu_memory.memory_allocated
    return None


class _ActionClock:
    """When an action starts and ends: the host's clock on the CPU; on CUDA, events on the current stream (the
    host runs ahead of the GPU), turned into wall-clock seconds after the step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self.origin, self.origin_seconds = torch.cuda.Event(enable_timing=True), time.time()
            self.origin.record()

    def now(self):
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """``mark`` (from ``now``) in ``time.time`` seconds; on CUDA, waits for it."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self.origin_seconds + self.origin.elapsed_time(mark) / 1e3


def _header(tensor: Tensor) -> Tensor:
    """A message's header, on its device: its number of dims, dtype (an index into _DTYPES) and shape, -1
    padded (on CUDA copied from pinned memory, so the host does not wait for the stream)."""
    values = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape] + [-1] * (_MAX_DIMS - tensor.dim())
    if tensor.device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(tensor.device, non_blocking=True)


def _failure_header(origin: int, length: int, device: torch.device) -> Tensor:
    """A header (``_header``'s layout) announcing that pipeline rank ``origin``'s step failed: its message,
    ``length`` utf-8 bytes, follows on the data's tag."""
    return torch.tensor([_FAILED, origin, length] + [-1] * (_MAX_DIMS - 1), dtype=torch.int64, device=device)


def _failure_error(text: str, origin: int, via: int, rank: int) -> Exception:
    """The exception a rank raises for the failure ``text`` (``"TypeError: ..."``) of pipeline rank ``origin``,
    learned from ``via``'s message: of the same class where it is a builtin exception, else a RuntimeError.
    ``_pipeline_failure`` on it: (origin, text, the ranks known to have failed), for ``_notify_peers``."""
    name, _, message = text.partition(": ")
    where = f"raised on pipeline rank {origin}; rank {rank} learned of it from rank {via} and ended its step too"
    cls = getattr(builtins, name, None)
    error = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            error = cls(f"{message} ({where})")
        except Exception:  # a builtin exception that takes other arguments
            error = None
    if error is None:
        error = RuntimeError(f"{text} ({where})")
    error._pipeline_failure = (origin, text, {origin, via})
    return error


def _describe(value) -> str:
    """What a stage or ``loss_fn`` returned, for an error message."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    if isinstance(value, (bool, int, float, complex)):
        return f"{type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"


def _check_stage_output(stage: int, out) -> None:
    """Refuses the output of a stage other than the last that is not one Tensor: it is the next stage's input,
    sent as one message (or handed over in memory)."""
    if not isinstance(out, Tensor):
        raise TypeError(f"stages[{stage}] must return a Tensor (stage {stage}'s output, the input of stage "
                        f"{stage + 1}), got {_describe(out)}")


def _check_loss(loss) -> None:
    """Refuses a ``loss_fn`` return that is not a 0-d floating-point Tensor: the micro-batch's loss, which its
    backward pass starts from and the step's mean loss adds up."""
    rule = (f"loss_fn must return a 0-d floating-point Tensor (the micro-batch's loss, which its backward pass starts "
            f"from), got {_describe(loss)}")
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        raise TypeError(rule)
    if loss.dim() != 0:
        raise ValueError(rule)


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
    """One pipeline rank's stages, run in its schedule's action order by ``step``.

    Between stages on different ranks, activations (forward) and their gradients (backward) travel as
    point-to-point messages on ``pp_mesh``'s group; between stages on one rank (zb-v's turn) they pass in memory.
    Under zb-h1 and zb-v the stages' linears are put in split mode in place (``enable_weight_grad_split``): B
    computes the input gradients and queues the weight gradients, which the W actions run. ``timeline`` holds
    the last step's ``TimedAction``s on this rank.

    A step in which a stage raises (or returns what the runtime refuses: a stage other than the last must return a
    Tensor, ``loss_fn`` a 0-d floating-point one) raises on every rank where the message order lets the failing rank
    tell its peers, with its message (``_notify_peers``): in the first step (its messages carry headers) when the
    failure comes before a stage's first message to a peer, as such errors do on the first micro-batch.

    A stage's output tensor gives up its storage once sent (its backward needs only its ``grad_fn``): code that
    keeps a reference to the very tensor a stage module returns (a forward hook, a module attribute, an op of the
    stage that saved it as an input) sees an empty tensor after the send; compute from it inside the stage.

    Args:
        stages: ``{stage index: module}`` for the stages this rank holds (``stages_of_rank``). What is sent
            between ranks (a stage's output, its input's gradient) has at most 6 dims and a float32, bfloat16,
            float16, float64, int64 or int32 dtype. A stage sharded with FSDP2 must itself be the ``fully_shard``
            root of its sharded blocks: it gathers its parameters once per step, at its first forward, keeps them
            through the micro-batches and reduce-scatters its gradients right after its last B or W; after the
            step FSDP2's defaults apply.
        pp_mesh: 1-D DeviceMesh of the pipeline ranks (rank d of the mesh is pipeline rank d). On CUDA its group
            must hold the NCCL backend (``"cpu:gloo,cuda:nccl"`` or ``"nccl"``) and every rank must have called
            ``torch.cuda.set_device``.
        schedule: one of ``SCHEDULES``.
        num_microbatches: micro-batches per step (interleaved-1f1b: divisible by pp).
        loss_fn: ``loss_fn(output, targets) -> scalar`` of the last stage's output of a micro-batch.
        virtual_stages: chunks per rank for interleaved-1f1b.
        loss_reduction: "mean": the step's loss is the mean of the micro-batches' ``loss_fn`` values; "sum":
            their sum (a ``loss_fn`` that divides by the whole step's token count already).
        fixed_shapes: every step gives each stage inputs of the first step's shapes and dtypes (as
            ``torch.distributed.pipelining`` and Megatron-LM assume): only the first step's messages carry
            headers, so later steps post every receive one action ahead of its reader. False (variable
            sequence lengths, say): every step's first message of each kind carries its header again. Either
            way the micro-batches of one step share their shapes (checked by the sender).
    """

    def __init__(self, stages: Mapping[int, nn.Module], *, pp_mesh: DeviceMesh, schedule: str,
                 num_microbatches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], virtual_stages: int = 1,
                 loss_reduction: str = "mean", fixed_shapes: bool = True):
        if not isinstance(pp_mesh, DeviceMesh) or pp_mesh.ndim != 1:
            raise TypeError(f"pp_mesh must be a 1-D DeviceMesh, got {pp_mesh!r}")
        self.pp, self.rank = pp_mesh.size(), pp_mesh.get_local_rank()

        def validate():  # and the schedule's plan for this rank
            if not isinstance(fixed_shapes, bool):
                raise TypeError(f"fixed_shapes must be a bool, got {type(fixed_shapes).__name__}")
            if loss_reduction not in ("mean", "sum"):
                raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
            if not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable(output, targets) -> loss, got {type(loss_fn).__name__}")
            self.schedule, self.virtual_stages, self.num_microbatches = schedule, virtual_stages, num_microbatches
            self.num_stages = num_stages(schedule, self.pp, virtual_stages)
            every_rank = every_rank_actions(schedule, self.pp, num_microbatches, virtual_stages)
            self.actions = every_rank[self.rank]
            # Each action's position in its rank's order, every rank's: when a message from a peer arrives, the
            # peer has received every message of ours that the action sending it, or an earlier one, consumed.
            self._position = {(a.kind, a.stage, a.microbatch): i
                              for actions in every_rank for i, a in enumerate(actions)}
            expected = stages_of_rank(schedule, self.pp, self.rank, virtual_stages)
            if not isinstance(stages, Mapping) or sorted(stages) != sorted(expected):
                got = sorted(stages) if isinstance(stages, Mapping) else type(stages).__name__
                raise ValueError(f"stages must map this rank's stage indices {expected} ({schedule}, "
                                 f"pp={self.pp}, rank {self.rank}) to modules, got {got}")
            for index, module in stages.items():
                if not isinstance(module, nn.Module):
                    raise TypeError(f"stages[{index}] must be an nn.Module, got {type(module).__name__}")
                if not isinstance(module, FSDPModule) and any(isinstance(m, FSDPModule) for m in module.modules()):
                    raise ValueError(f"stages[{index}] holds fully_shard-ed modules but is not itself "
                                     f"fully_shard-ed: call fully_shard on the stage module too (its root), so that "
                                     f"its gradients are reduced once per step, after its last backward pass")
        # Every pipeline rank refuses, or none does: the ranks then exchange messages by the schedule's plan.
        check_agreement(pp_mesh.get_group(), "PipelineSchedule",
                        {"schedule": schedule, "num_microbatches": num_microbatches,
                         "virtual_stages": virtual_stages, "loss_reduction": loss_reduction,
                         "fixed_shapes": fixed_shapes}, validate)
        self.loss_reduction = loss_reduction
        self.split = splits_weight_grad(schedule)
        self.stages = {i: enable_weight_grad_split(m) if self.split else m for i, m in stages.items()}
        self.group = pp_mesh.get_group()
        self.loss_fn = loss_fn
        self.weight_grads = WeightGradStore()
        self.timeline: list[TimedAction] = []
        self._failed_step: str | None = None  # why an earlier step raised while its messages were in flight
        # headers (a step whose shapes the receivers do not know) -> boundary -> the messages posted there
        self._posts: dict[bool, dict[int, list[PostedOp]]] = {True: {}, False: {}}
        for headers, posts in self._posts.items():
            for op in message_plan(schedule, self.pp, num_microbatches, virtual_stages, headers)[self.rank]:
                posts.setdefault(op.boundary, []).append(op)
        self.fixed_shapes = fixed_shapes
        self._received_meta: dict = {}  # (direction, stage) -> (shape, dtype) of the messages this rank receives
        self._sent_meta: dict = {}  # and of those it sends
        # The position of each stage's last gradient action (B, or W under a split): its FSDP2 reduction.
        self._last_grad_action = {a.stage: i for i, a in enumerate(self.actions) if a.kind in "BW"}

    # -- messages ------------------------------------------------------------------------------------------

    def _tag(self, direction: int, stage: int, microbatch: int) -> int:
        """Two tags per message (header, data), unique per direction, receiving stage and micro-batch (gloo
        matches by tag; NCCL by the order, which ``message_plan`` makes the same on both ranks)."""
        return 2 * ((direction * self.num_stages + stage) * self.num_microbatches + microbatch)

    def _send(self, tensor: Tensor, direction: int, to_stage: int, microbatch: int) -> None:
        """Hands ``tensor`` to ``to_stage``: in memory on this rank, else into the outbox, which the message
        plan posts from at this or a later boundary."""
        key = (direction, to_stage, microbatch)
        if rank_of_stage(self.schedule, self.pp, to_stage, self.virtual_stages) == self.rank:
            self._in_memory[key] = tensor
            return
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"a pipeline stage's output must have at most {_MAX_DIMS} dims and a dtype in "
                             f"{_DTYPES}, got shape {tuple(tensor.shape)} and {tensor.dtype}")
        layout = (list(tensor.shape), tensor.dtype)
        expected = self._sent_meta.setdefault((direction, to_stage), layout)
        if layout != expected:  # only the first message of each kind (of the first step) carries a header
            what = "activation" if direction == FORWARD else "gradient"
            every = "every micro-batch and, with fixed_shapes=True, every step" if self.fixed_shapes else \
                "every micro-batch"
            raise ValueError(f"stage {to_stage}'s input {what} of micro-batch {microbatch} has shape {layout[0]} "
                             f"and dtype {layout[1]}, but earlier micro-batches' had {expected[0]} and "
                             f"{expected[1]}: {every} must give the stages the same shapes")
        self._outbox[key] = tensor.contiguous()

    def _post(self, boundary: int, clock: "_ActionClock"):
        """Posts the messages the plan puts at ``boundary`` (before the action at that position), one op at a
        time in the plan's order, so that each op gets its own work: a wait covers the ops posted before it on
        the link, never a later action's. The first message of each (direction, stage) of a step is preceded
        by a header (its shape and dtype), which the receiver waits for before it posts the data's receive.
        Returns ``clock``'s mark where that wait began (None if none did): the rank is idle from there."""
        waiting_from = None
        for op in self._posts[self._headers].get(boundary, ()):
            m = op.message
            key, kind = (m.direction, m.stage, m.microbatch), (m.direction, m.stage)  # kind: of the same shape
            tag = self._tag(*key)
            if op.is_send:
                data = self._outbox.pop(key)
                consumer = self._position[(_PASS_OF[m.direction], m.stage, m.microbatch)]
                for message, message_tag in ([(_header(data), tag)] if op.with_header else []) + [(data, tag + 1)]:
                    work = dist.isend(message, group=self.group, group_dst=m.dst, tag=message_tag)
                    self._sends.append(_PendingSend(work, message, m.dst, consumer))
                self._posted_sends.add(key)
                continue
            if op.with_header:
                header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                waiting_from = clock.now() if waiting_from is None else waiting_from
                dist.irecv(header, group=self.group, group_src=m.src, tag=tag).wait()
                dims, dtype, *shape = header.tolist()
                if dims == _FAILED:  # the peer's step failed: dtype holds the failing rank, shape[0] the text's size
                    raise self._peer_failure(m.src, dtype, shape[0], tag + 1)
                self._received_meta[kind] = (shape[:dims], _DTYPES[dtype])
            shape, dtype = self._received_meta[kind]
            data = torch.empty(shape, dtype=dtype, device=self.device)
            self._inbox[key] = (m.src, dist.irecv(data, group=self.group, group_src=m.src, tag=tag + 1), data)
        return waiting_from

    def _peer_failure(self, src: int, origin: int, length: int, tag: int) -> Exception:
        """The error announced by a failure header from ``src``: pipeline rank ``origin``'s message, whose
        ``length`` bytes follow on ``tag``."""
        text = torch.empty(length, dtype=torch.uint8, device=self.device)
        dist.irecv(text, group=self.group, group_src=src, tag=tag).wait()
        return _failure_error(bytes(text.tolist()).decode(errors="replace"), origin, src, self.rank)

    def _notify_peers(self, origin: int, text: str, failed: set[int]) -> None:
        """Tells each peer not in ``failed`` that this step failed (``text``, first raised on pipeline rank
        ``origin``) in place of the first send to it in the plan that this rank has not posted, where that send
        carries a header (the first message of its kind in a step whose messages carry headers): the peer waits
        for a header before it posts the data's receive, so it reads a failure header there, raises the same
        error (``_peer_failure``) and tells its own peers. Where that send carries no header, the peer's receive
        is posted for data of a known size, which cannot say it: that peer waits for its timeout, as before.
        The messages stay in flight like the step's others (``_abandon_step``); one to a rank that failed too
        is never read. Best effort: an error while telling (a broken group) is dropped, the step's own is raised."""
        encoded, told = text.encode(), set(failed)
        posts = self._posts[self._headers]
        try:
            for op in (op for boundary in sorted(posts) for op in posts[boundary]):
                m = op.message
                key = (m.direction, m.stage, m.microbatch)
                if not op.is_send or m.dst in told or key in self._posted_sends:
                    continue
                told.add(m.dst)
                if op.with_header:
                    tag = self._tag(*key)
                    body = torch.tensor(list(encoded), dtype=torch.uint8, device=self.device)
                    for message, message_tag in ((_failure_header(origin, len(encoded), self.device), tag),
                                                 (body, tag + 1)):
                        work = dist.isend(message, group=self.group, group_dst=m.dst, tag=message_tag)
                        _KEPT_AFTER_A_FAILED_STEP.append(work)
        except Exception:  # telling is best effort: the caller re-raises the step's own error
            pass

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

    def _receive(self, direction: int, stage: int, microbatch: int, from_stage: int) -> Tensor:
        key = (direction, stage, microbatch)
        if key in self._in_memory:
            return self._in_memory.pop(key)
        peer, work, data = self._inbox.pop(key)
        work.wait()
        self._release_sends(peer, before=self._position[(_PASS_OF[direction], from_stage, microbatch)])
        return data

    def _input_source(self, action: Action) -> tuple[int, int, int, int] | None:
        """(direction, stage, micro-batch, from stage) of the message an action waits for, or None."""
        if action.kind == "F" and action.stage > 0:
            return FORWARD, action.stage, action.microbatch, action.stage - 1
        if action.kind == "B" and action.stage < self.num_stages - 1:
            return BACKWARD, action.stage, action.microbatch, action.stage + 1
        return None

    # -- actions -------------------------------------------------------------------------------------------

    def _forward(self, stage: int, microbatch: int, received: Tensor | None) -> None:
        if stage == 0:
            x = self._inputs[microbatch]
        else:
            x = received.detach()
            x.requires_grad_(x.is_floating_point())
        out = self.stages[stage](x, **self._stage_inputs[microbatch])
        if stage == self.num_stages - 1:
            loss = self.loss_fn(out, self._targets[microbatch])
            _check_loss(loss)
            if self.loss_reduction == "mean":
                loss = loss / self.num_microbatches
            self._losses.append(loss.detach())
            self._saved[(stage, microbatch)] = (x, loss)
        else:
            _check_stage_output(stage, out)
            self._saved[(stage, microbatch)] = (x, out)
            self._send(out.detach(), FORWARD, stage + 1, microbatch)
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
            self._send(x.grad, BACKWARD, stage - 1, microbatch)

    def step(self, inputs: Tensor, targets: Tensor, stage_inputs: Mapping[str, Tensor] | None = None) -> Tensor:
        """One training step (forward and backward of every micro-batch; no optimizer step): returns the
        step's loss (0-d, the same on every rank) and leaves the gradients in the stages' parameters.

        Every rank passes the same ``inputs`` and ``targets`` (only the first stage reads the inputs, only the last
        the targets), split along dim 0 into ``num_microbatches`` equal micro-batches. The loss is
        ``mean_i loss_fn(last_stage(...(inputs_i)), targets_i)`` (the sum under ``loss_reduction="sum"``), so
        with a mean-reducing ``loss_fn`` the gradients equal those of ``loss_fn(model(inputs), targets)`` in one
        process. ``stage_inputs``: tensors every stage takes besides its input (positions, document ids), split
        along dim 0 like ``inputs``: each stage's forward gets micro-batch i's slices as keyword arguments.

        A step that raises once its actions have begun (a stage's error, a peer's timeout) leaves the pipeline
        unusable: later calls raise RuntimeError, since that step's messages may still be in flight. Its peers
        raise the same error where the message order lets this rank tell them (see the class docstring)."""
        stage_inputs = {} if stage_inputs is None else stage_inputs
        if not isinstance(stage_inputs, Mapping):
            raise TypeError(f"stage_inputs must be a mapping of names to tensors, got {type(stage_inputs).__name__}")
        for name, t in (("inputs", inputs), ("targets", targets),
                        *((f"stage_inputs[{key!r}]", value) for key, value in stage_inputs.items())):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
            if t.dim() == 0 or t.shape[0] % self.num_microbatches:
                raise ValueError(f"{name}.size(0) must be divisible by num_microbatches={self.num_microbatches}, "
                                 f"got shape {tuple(t.shape)}")
        if self._failed_step is not None:
            raise RuntimeError(f"an earlier step() raised ({self._failed_step}): messages of that step may still be "
                               "in flight between the ranks and would be read as this step's, so this pipeline "
                               "cannot run another step; end the job and restart it from a checkpoint")
        self.device = inputs.device
        self._inputs, self._targets = inputs.chunk(self.num_microbatches), targets.chunk(self.num_microbatches)
        chunks = {key: value.chunk(self.num_microbatches) for key, value in stage_inputs.items()}
        self._stage_inputs = [{key: parts[i] for key, parts in chunks.items()} for i in range(self.num_microbatches)]
        self._saved, self._in_memory, self._outbox, self._inbox = {}, {}, {}, {}
        self._sends, self._losses, self._posted_sends = [], [], set()
        self._headers = not (self.fixed_shapes and self.timeline)  # a step ran: the receivers know the shapes
        if self._headers:
            self._received_meta, self._sent_meta = {}, {}
        self.weight_grads.clear()
        try:
            return self._run_actions()
        except BaseException as error:
            self._abandon_step(error)
            raise

    def _abandon_step(self, error: BaseException) -> None:
        """After an action raised: refuses later steps, whose messages would share tags with this step's
        (a message of another rank, still in flight, would be read as a later step's), and keeps this rank's
        posted messages (their works, which hold the buffers) for the rest of the process. Gloo reads a message
        into its receive buffer from its own thread: a buffer freed before its data arrives would be written
        after the free, or wedge the link for every later message. Then tells the peers (``_notify_peers``)."""
        self._failed_step = f"{type(error).__name__}: {error}"
        _KEPT_AFTER_A_FAILED_STEP.extend(work for _, work, _ in self._inbox.values())
        _KEPT_AFTER_A_FAILED_STEP.extend(send.work for send in self._sends)
        origin, text, failed = getattr(error, "_pipeline_failure", (self.rank, self._failed_step, set()))
        self._notify_peers(origin, text, failed | {self.rank})

    def _run_actions(self) -> Tensor:
        run = {"F": self._forward, "B": self._backward, "W": lambda s, i, _: self.weight_grads.run((s, i))}
        live_bytes = _live_bytes_counter(self.device)
        clock = _ActionClock(self.device)
        for module in self.stages.values():
            if isinstance(module, FSDPModule):  # accumulate over the micro-batches; reduce once (below)
                module.set_requires_gradient_sync(False)
                module.set_reshard_after_forward(False)
                module.set_reshard_after_backward(False)
                module.set_is_last_backward(False)
        timed = []
        self._post(0, clock)
        for position, action in enumerate(self.actions):
            source = self._input_source(action)
            received = self._receive(*source) if source else None  # waiting for it is idle time, not the action's
            start = clock.now()
            run[action.kind](action.stage, action.microbatch, received)
            # The ops posted next begin with the messages this action made: part of its work (gloo copies a
            # message whose receive is posted into the socket in this thread, about 1 ms per 4 MB here).
            waiting_from = self._post(position + 1, clock)
            end = clock.now() if waiting_from is None else waiting_from
            timed.append((action, start, end, live_bytes() if live_bytes is not None else None))
            if position == self._last_grad_action[action.stage] and isinstance(self.stages[action.stage], FSDPModule):
                _reduce_fsdp_gradients(self.stages[action.stage])
        for send in self._sends:
            send.work.wait()
        self.timeline = [TimedAction(a.kind, a.stage, a.microbatch, clock.seconds(start), clock.seconds(end), held)
                         for a, start, end, held in timed]
        losses = [loss.float() for loss in self._losses]  # fp32 on every rank, whatever the logits' dtype
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # the last stage's rank holds the sum; the others add 0
        self._inputs = self._targets = self._stage_inputs = None
        self._saved = self._sends = self._inbox = self._outbox = None
        return loss


# The works of messages that a step which raised left in flight (Pipeline._keep_messages_in_flight).
_KEPT_AFTER_A_FAILED_STEP: list[dist.Work] = []


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
