"""README example: a tensor through a torchpar Queue to a spawned child, which changes it in place."""
import torch
import torchpar.multiprocessing as mp

def worker(q, done):
    t = q.get()
    t += 1                      # the parent's tensor changes: shared memory, no copy
    done.send("ok")

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, (here, there) = ctx.Queue(), ctx.Pipe()
    p = ctx.Process(target=worker, args=(q, there))
    p.start()
    t = torch.zeros(4)
    q.put(t)
    assert here.recv() == "ok" and t.sum().item() == 4
    p.join()
    print("readme example ok")
