"""DualPipe's action order, transcribed from ``DualPipe.step`` (deepseek-ai/DualPipe, dualpipe/dualpipe.py, commit
3da1bbea53606543d7f5f232338fc58096db30e3) with the computation and communication left out: a test oracle.

The control flow (steps 1..8, the per-phase counters, the ``phase ^= is_in_second_half`` flip, the middle
ranks' unpaired first pair of step 4, where ``enable_zb`` is on) is kept line for line; each ``*_compute_chunk``
records an action instead of running a module, and ``_recv_*``/``_send_*``/``_commit_and_wait_comm`` are dropped,
since they only post or wait for P2P operations and never change which chunk a rank computes next.

Mapping to fpipe (p ranks, m microbatches, DualPipe's ``num_chunks`` is m):

- after the flip, phase 0 runs ``module[0]`` in the forward direction and phase 1 runs ``module[1]`` in the reverse
  direction on every rank: rank r holds stage r in phase 0 and stage p-1-r in phase 1;
- phase 0's chunk i is microbatch i and phase 1's chunk i is microbatch m/2 + i (i in 0..m/2-1);
- a backward with ``enable_zb=False`` computes weight gradients inline: ``sBi``. With ``enable_zb=True`` the weight
  gradient functions are cached and ``WeightGradStore.flush()`` enqueues them as one entry of a FIFO queue: the
  backward is ``sIi``, and the ``_weight_chunk`` that pops that entry (``WeightGradStore.pop()``, oldest first) is
  ``sWi``. No call runs a deferred weight part itself; ``flush`` only enqueues.
- ``_forward_backward_chunk(phase0, phase1)`` is ``sFi&tBj``: its backward never defers (``WeightGradStore.enabled``
  is False outside ``_backward_compute_chunk``), overlapped or not.
"""

from __future__ import annotations

from collections import deque


class _DualPipeRecorder:
    """One rank's ``DualPipe`` with ``forward_only=False``, reduced to the state that decides the order."""

    def __init__(self, rank: int, num_ranks: int, num_chunks: int) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.half_num_chunks = num_chunks // 2
        self.is_in_second_half = int(rank >= num_ranks // 2)
        self.is_middle_rank = rank in (num_ranks // 2 - 1, num_ranks // 2)
        self.current_f_chunk_id = [0, 0]
        self.current_b_chunk_id = [0, 0]
        self.weight_grad_queue: deque[str] = deque()  # WeightGradStore.funcs_queue, one entry per flush
        self.actions: list[str] = []

    def _name(self, phase: int, kind: str, chunk_id: int) -> str:
        # ``phase`` is already flipped: 0 is module[0] (stage r), 1 is module[1] (stage p-1-r).
        stage = self.rank if phase == 0 else self.num_ranks - 1 - self.rank
        return f"{stage}{kind}{chunk_id + phase * self.half_num_chunks}"

    def _forward_compute_chunk(self, phase: int) -> str:
        phase ^= self.is_in_second_half
        chunk_id = self.current_f_chunk_id[phase]
        self.current_f_chunk_id[phase] += 1
        return self._name(phase, "F", chunk_id)

    def _backward_compute_chunk(self, phase: int, enable_zb: bool = False) -> str:
        phase ^= self.is_in_second_half
        chunk_id = self.current_b_chunk_id[phase]
        self.current_b_chunk_id[phase] += 1
        if enable_zb:  # WeightGradStore.enabled = True; backward; WeightGradStore.flush()
            self.weight_grad_queue.append(self._name(phase, "W", chunk_id))
            return self._name(phase, "I", chunk_id)
        return self._name(phase, "B", chunk_id)

    def _forward_chunk(self, phase: int) -> None:
        self.actions.append(self._forward_compute_chunk(phase))

    def _backward_chunk(self, phase: int, enable_zb: bool = False) -> None:
        self.actions.append(self._backward_compute_chunk(phase, enable_zb))

    def _forward_backward_chunk(self, phase0: int, phase1: int) -> None:
        # _forward_backward_compute_chunk: forward counter first, then backward counter, no zero bubble.
        forward = self._forward_compute_chunk(phase0)
        backward = self._backward_compute_chunk(phase1)
        self.actions.append(f"{forward}&{backward}")

    def _weight_chunk(self) -> None:
        # Assume FIFO
        if not self.weight_grad_queue:
            raise AssertionError("Pop empty queue.")
        self.actions.append(self.weight_grad_queue.popleft())

    def step(self) -> list[str]:
        num_ranks = self.num_ranks
        num_half_ranks = num_ranks // 2
        half_rank = min(self.rank, num_ranks - 1 - self.rank)
        half_num_chunks = self.half_num_chunks

        # Step 1: nF0
        step_1 = (num_half_ranks - half_rank - 1) * 2
        for _ in range(step_1):
            self._forward_chunk(0)

        # Step 2: nF0F1
        step_2 = half_rank + 1
        for _ in range(step_2):
            self._forward_chunk(0)
            self._forward_chunk(1)

        # Step 3: nB1W1F1 (Use zero bubble)
        step_3 = num_half_ranks - half_rank - 1
        for _ in range(step_3):
            self._backward_chunk(1, enable_zb=True)
            self._weight_chunk()
            self._forward_chunk(1)

        # Step 4 (Main step): nF0B1F1B0
        step_4 = half_num_chunks - num_ranks + half_rank + 1
        for i in range(step_4):
            if i == 0 and self.is_middle_rank:
                # NOTE: We don't overlap these two chunks to further reduce bubble size.
                self._forward_chunk(0)
                self._backward_chunk(1)
            else:
                self._forward_backward_chunk(0, 1)
            self._forward_backward_chunk(1, 0)

        # Step 5: nB1F1B0
        step_5 = num_half_ranks - half_rank - 1
        for _ in range(step_5):
            self._backward_chunk(1)
            self._forward_backward_chunk(1, 0)

        # Step 6: nB1B0 (The second half of the chunks use zero bubble)
        step_6 = half_rank + 1
        enable_zb = False
        for i in range(step_6):
            if i == step_6 // 2 and half_rank % 2 == 1:
                enable_zb = True
            self._backward_chunk(1, enable_zb=enable_zb)
            if i == step_6 // 2 and half_rank % 2 == 0:
                enable_zb = True
            self._backward_chunk(0, enable_zb=enable_zb)

        # Step 7: nWB0 (Use zero bubble)
        step_7 = num_half_ranks - half_rank - 1
        for _ in range(step_7):
            self._weight_chunk()
            self._backward_chunk(0, enable_zb=True)

        # Step 8: nW
        step_8 = half_rank + 1
        for _ in range(step_8):
            self._weight_chunk()
        if self.weight_grad_queue:
            raise AssertionError("WeightGradStore.funcs_queue is not empty after step 8.")
        return self.actions


def dual_pipe_order(num_ranks: int, num_microbatches: int) -> list[list[str]]:
    """Each rank's actions in the order ``DualPipe.step`` runs them (see the module docstring for the mapping).

    Args:
        num_ranks: p, even; rank r holds stages r and p-1-r.
        num_microbatches: m, DualPipe's ``num_chunks``: even and at least 2p.

    Returns:
        One list per rank of ``sFi``, ``sBi``, ``sIi``, ``sWi`` and ``sFi&tBj`` strings.

    Raises:
        ValueError: if the sizes fail DualPipe's own assertions.
    """
    if num_ranks < 2 or num_ranks % 2 != 0:
        raise ValueError(f"DualPipe needs an even number of ranks, at least 2 (num_ranks: {num_ranks}).")
    if num_microbatches % 2 != 0 or num_microbatches < 2 * num_ranks:
        raise ValueError(
            "DualPipe needs an even number of microbatches, at least twice the ranks "
            f"(num_microbatches: {num_microbatches}, num_ranks: {num_ranks})."
        )
    return [_DualPipeRecorder(rank, num_ranks, num_microbatches).step() for rank in range(num_ranks)]
