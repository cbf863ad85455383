"""One-off probe of torch._grouped_mm on the GPU machine: ragged offsets in backward,
zero-size groups, strided weight views. Prints PASS/FAIL lines."""
import torch
torch.manual_seed(0)
dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count)
def ref_gmm(a, b_t, offs):
    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):
        outs.append(a[start:end].float() @ b_t[g].float()); start = end
    return torch.cat(outs)
for counts in ([3, 0, 17, 1, 43], [0, 0, 64, 0, 0], [5, 7, 9, 11, 13], [0, 0, 0, 0, 0]):
    E, K, N = len(counts), 256, 384
    M = sum(counts)
    try:
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        W = torch.randn(E, 2 * N, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        bt = W[:, :N].transpose(-2, -1)
        out = torch._grouped_mm(a, bt, offs=offs)
        g = torch.randn_like(out)
        out.backward(g)
        a2 = a.detach().float().requires_grad_(); W2 = W.detach().float().requires_grad_()
        ref = ref_gmm(a2, W2[:, :N].transpose(-2, -1), offs) if M else torch.zeros(0, N, device=dev)
        if M: ref.backward(g.float())
        ea = ((a.grad.float() - a2.grad).norm() / a2.grad.norm().clamp_min(1e-9)).item() if M else 0.0
        ew = ((W.grad.float() - (W2.grad if M else 0)).norm() / (W2.grad.norm().clamp_min(1e-9) if M else 1)).item()
        eo = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-9)).item() if M else 0.0
        print("PASS" if max(ea, ew, eo) < 2e-2 else "FAIL", counts, f"out {eo:.2e} da {ea:.2e} dW {ew:.2e}")
    except Exception as e:
        print("ERROR", counts, type(e).__name__, str(e)[:300])
