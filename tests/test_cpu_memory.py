"""torchdist_ext.cpu_memory: the counting CPU allocator, in a fresh process (installing it is for the process's
life). Counts are exact: a storage of n bytes counts n."""

import subprocess
import sys
import textwrap



def run_in_fresh_process(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_counts_storages_and_peak():
    run_in_fresh_process("""
        import torch
        from torchdist_ext import cpu_memory

        try:
            cpu_memory.memory_allocated()
        except RuntimeError as error:
            assert "call torchdist_ext.cpu_memory.track() first" in str(error)
        else:
            raise AssertionError("read before track() did not raise")
        earlier = torch.ones(1000)           # before track(): never counted, not even when freed
        cpu_memory.track()
        cpu_memory.track()                   # a no-op the second time
        start = cpu_memory.memory_allocated()
        a = torch.ones(1000)                 # 4000 bytes
        b = torch.ones(500, dtype=torch.float64)  # 4000 bytes
        assert cpu_memory.memory_allocated() - start == 8000
        del a, earlier
        assert cpu_memory.memory_allocated() - start == 4000
        assert cpu_memory.max_memory_allocated() - start == 8000
        cpu_memory.reset_peak_memory_stats()
        assert cpu_memory.max_memory_allocated() == cpu_memory.memory_allocated()
        c = b.view(-1).clone()               # one more storage, then freed
        del c
        assert cpu_memory.max_memory_allocated() - cpu_memory.memory_allocated() == 4000
    """)


def test_training_step_and_threads_are_counted_to_zero():
    """A model's forward, backward and optimizer step (with intra-op threads and autograd) leave exactly the
    bytes of the tensors still alive: every free reaches the counter, whichever thread frees."""
    run_in_fresh_process("""
        import torch
        from torchdist_ext import cpu_memory

        cpu_memory.track()
        torch.set_num_threads(2)
        start = cpu_memory.memory_allocated()
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            model(torch.randn(32, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        params = sum(p.numel() * 4 for p in model.parameters())
        states = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
        assert cpu_memory.memory_allocated() - start == params + states, (cpu_memory.memory_allocated() - start,
                                                                         params, states)
        assert cpu_memory.max_memory_allocated() > cpu_memory.memory_allocated()
    """)
