"""Grouped KV heads in the drafter's masked attention: copied (repeat_interleave) vs SDPA's enable_gqa.

The drafter (dflash_eval/drafter/model.py) passes ``enable_gqa=True`` with its boolean block mask.
This prints, side by side in one run, time and peak memory of both on the replay's ``rows``
shapes (C rows of B queries over K context keys + the block), their max difference, and whether
the memory-efficient kernel accepts grouped heads with a mask.

    python3 bench/sdpa_gqa.py            # CUDA (bf16)

H200, torch 2.11 (2026-12-01): enable_gqa 3.7x faster, 4.6x less peak memory at
(C=256, 16/4 heads, B=16, K=1024); 2.9x / 3.8x at (512, 9/3, 8, 600); identical outputs; the
memory-efficient kernel refuses grouped heads with a mask ("No available kernel"). In the whole
replay (``python3 bench/replay.py --case big --big-n 16``, same day) enable_gqa everywhere gave
rows 47.0 ms/sample (51.0 with the copy) but packed 211 ms (158), sequential 3.46 s (2.80) and
the online loop 49.9 s per sample (31.2): the drafter keeps the copy on CUDA, enable_gqa on CPU.
"""
import torch, torch.nn.functional as F, time
dev = "cuda"
torch.manual_seed(0)
for (C, nh, nkv, B, K, hd) in [(256, 16, 4, 16, 1024, 128), (512, 9, 3, 8, 600, 64)]:
    q = torch.randn(C, nh, B, hd, device=dev, dtype=torch.bfloat16)
    k = torch.randn(C, nkv, K + B, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.rand(C, 1, B, K + B, device=dev) > 0.3
    rep = nh // nkv
    def copy():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for name, f in (("copy", copy), ("enable_gqa", gqa)):
        for _ in range(3): f()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(20): o = f()
        torch.cuda.synchronize()
        print(f"C={C} nh={nh} nkv={nkv} B={B} K={K}: {name:10s} {1e3*(time.perf_counter()-t)/20:.3f} ms, peak {torch.cuda.max_memory_allocated()/2**20:.0f} MiB")
    print("max abs diff", (copy().float() - gqa().float()).abs().max().item())
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        try:
            gqa(); print("efficient kernel accepts enable_gqa + mask")
        except RuntimeError as e:
            print("efficient kernel refuses enable_gqa + mask:", str(e).splitlines()[0][:200])
print(torch.__version__, torch.cuda.get_device_name())
