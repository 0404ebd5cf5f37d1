"""Train the demo model ``tiny-v41-chat``: a small DeepSeek-V4.1 (every V4.1 mechanism on) on
the Python documentation, then its DSpark draft stages, and export it in the official layout.

    PYTHONPATH=. python tools/train_tiny.py --config shipped --device cuda --out DIR
    PYTHONPATH=. python tools/train_tiny.py --config small --steps 30 --out /tmp/t   (CPU test)
    PYTHONPATH=. python tools/train_tiny.py --evaluate DIR/tiny-v41-chat              (engine, CPU)

Steps (one command): (1) corpus ``tools/demo_data.py`` (PSF-licensed Python docs, chat samples
rendered with deepseek-recipe's V4.1 encoding, a held-out split by document); (2) a byte-level
BPE on the training split with DeepSeek's special tokens (``app.model.tokenizer``'s spellings
at the same ids, plus a DSpark noise token at the last id); (3) the target model
(``app.model.model.DeepseekModel``, the serving model's own modules) trained with plain torch
through the full-sequence reference forward (``tests.support.reference``: pure torch, autograd
works; on CUDA inside ``reference_kernels()`` so no Triton kernel runs), packed sequences,
next-token loss, AdamW, router biases balanced without an auxiliary loss (noaux_tc: the
bias moves against each expert's load); (4) the ``mtp.*`` DSpark stages on the frozen
target: the engine's own drafter (``app.model.dspark.DSparkDrafter.draft``) over context KV
made from the target features of the tap layers, distilling the target's next-token
distributions at the 5 block rows (the Markov chain teacher-forced with the text) and its
confidence head on whether each draft's argmax equals the target's; (5) held-out perplexity
beside a unigram baseline; (6) export through ``app.model.tiny.write_checkpoint`` (fp8 32x32
blocks with e8m0 scales, packed fp4 experts, fp8 Engram rows), reload through
``app.model.loader.load_model``, and the quantization loss measured (logits, greedy tokens,
held-out perplexity); (7) ``train_record.json`` and ``loss.png`` (a pure-Python PNG writer).

Seeds are fixed. Without ``--steps`` the run is sized by wall time (``--minutes``: 80% target,
20% DSpark); the record keeps the step counts, so ``--steps A --dspark-steps B`` replays it.
``--evaluate`` loads an exported model with the engine (``app.engine.llm.LLM``): greedy
answers to chat prompts through the engine beside the reference forward of the loaded model,
and DSpark mean acceptance lengths (k = 3 and 5, greedy and temperature 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python tools/train_tiny.py`: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.model.config import ModelConfig  # noqa: E402
from app.model.dspark import DSparkDrafter  # noqa: E402
from app.model.engram_hash import compressed_token_map  # noqa: E402
from app.model.kv_store import KVRows  # noqa: E402
from app.model.model import DeepseekModel  # noqa: E402
from app.model.moe import Gate  # noqa: E402
from app.model.tiny_config import v41_schedule_config  # noqa: E402
from app.model.tokenizer import SPECIAL_TOKENS  # noqa: E402
from kernels.dispatch import reference_kernels  # noqa: E402
from tests.support.reference import reference_logits  # noqa: E402
from tools import demo_data  # noqa: E402

NOISE_TOKEN = "<｜dspark▁noise｜>"
NAME = demo_data.SERVED_NAME


# ---- configs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """The knobs of one model size and its training run."""

    vocab: int
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_lora: int
    window: int
    index_topk: int
    cand_blocks: int
    cand_block: int
    experts: int
    top_k: int
    inter: int
    engram_vocab: int
    engram_heads: int
    engram_dim: int
    dspark_experts: int
    markov_rank: int
    seq_len: int  # tokens per training sequence (one forward)
    lr: float
    dspark_lr: float
    dspark_anchors: int  # anchors (draft blocks) per DSpark step


SIZES = {
    # CPU test size: seconds per run
    "small": Size(vocab=512, hidden=64, heads=4, head_dim=64, rope_dim=16, q_lora=32,
                  o_lora=32, window=8, index_topk=6, cand_blocks=3, cand_block=2, experts=8,
                  top_k=2, inter=32, engram_vocab=97, engram_heads=2, engram_dim=32,
                  dspark_experts=4, markov_rank=16, seq_len=128, lr=1e-2, dspark_lr=3e-3,
                  dspark_anchors=32),
    # the shipped demo model (~7 minutes on one H200)
    "shipped": Size(vocab=2048, hidden=256, heads=4, head_dim=64, rope_dim=16, q_lora=128,
                    o_lora=64, window=64, index_topk=32, cand_blocks=16, cand_block=4,
                    experts=8, top_k=2, inter=128, engram_vocab=2048, engram_heads=2,
                    engram_dim=32, dspark_experts=4, markov_rank=32, seq_len=2048, lr=2e-3,
                    dspark_lr=2e-3, dspark_anchors=256),
}  # fmt: skip


def demo_config(size: Size, n_compressed: int, noise_id: int) -> dict:
    """Official-layout config.json of the demo model: the tiny V4.1 layer schedule
    (``app.model.tiny_config``: SWA, SWA+Engram, Full r2, Reuse r2+Engram, Full r1 candidate
    source, Reuse, Reindex, Reuse; 3 DSpark stages tapping layers 5-7) at ``size``."""
    raw = v41_schedule_config(
        n_compressed,
        engram_vocab=size.engram_vocab,
        engram_heads=size.engram_heads,
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        head_dim=size.head_dim,
        qk_rope_head_dim=size.rope_dim,
        q_lora_rank=size.q_lora,
        o_lora_rank=size.o_lora,
        sliding_window=size.window,
        index_topk=size.index_topk,
        n_routed_experts=size.experts,
        num_experts_per_tok=size.top_k,
        moe_intermediate_size=size.inter,
        candidate_topk_blocks=size.cand_blocks,
        candidate_block_size=size.cand_block,
        engram_head_dim=size.engram_dim,
        dspark_noise_token_id=noise_id,
        dspark_markov_rank=size.markov_rank,
        dspark_n_routed_experts=size.dspark_experts,
    )
    raw["image_token_id"] = SPECIAL_TOKENS.index("<｜image｜>")
    return raw


# ---- tokenizer and data -------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE of ``vocab`` ids on ``texts``: DeepSeek's special tokens at the ids of
    ``app.model.tokenizer`` (bos 0, eos 1, pad 2, ...), the DSpark noise token last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 1,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([NOISE_TOKEN])
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, s
    assert tok.get_vocab_size(with_added_tokens=True) == vocab, tok.get_vocab_size()
    return tok


def tokenizer_files(tok, out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` as ``app.model.tokenizer`` writes them."""
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def encode_records(tok, records: list[dict]) -> dict[str, list[list[int]]]:
    """Token ids per (kind, split): text documents as ``bos text eos``; chat records are
    rendered with their own bos and eos spellings."""
    out: dict[str, list[list[int]]] = {}
    texts = [r["text"] for r in records]
    encs = tok.encode_batch(texts)
    for r, e in zip(records, encs, strict=True):
        ids = e.ids if r["kind"] == "chat" else [0, *e.ids, 1]
        out.setdefault(f"{r['kind']}_{r['split']}", []).append(ids)
    return out


class Stream:
    """Training sequences of ``length`` + 1 tokens: documents and chat samples (chat
    repeated ``chat_repeat`` times per epoch) shuffled per epoch and concatenated."""

    def __init__(
        self,
        docs: list[list[int]],
        chats: list[list[int]],
        length: int,
        seed: int,
        chat_repeat: int = 2,
    ) -> None:
        self.items = docs + chats * chat_repeat
        self.length, self.rng = length, random.Random(seed)
        self.buf: list[int] = []
        self.epoch = 0

    def next(self) -> list[int]:
        while len(self.buf) < self.length + 1:
            order = list(range(len(self.items)))
            self.rng.shuffle(order)
            for i in order:
                self.buf.extend(self.items[i])
            self.epoch += 1
        seq, self.buf = self.buf[: self.length + 1], self.buf[self.length :]
        return seq

    @property
    def tokens_per_epoch(self) -> int:
        return sum(len(x) for x in self.items)


# ---- model --------------------------------------------------------------------------------


def init_model(cfg: ModelConfig, token_map: list[int], seed: int) -> DeepseekModel:
    """The serving model's modules with training init: linears N(0, 1/fan_in) (output
    projections scaled by 1/sqrt(2 * layers)), norms 1, tables N(0, 1), mHC as the tiny
    checkpoints (small fn, base 0, scales 1), sinks and router biases 0."""
    g = torch.Generator().manual_seed(seed)
    model = DeepseekModel(cfg, engram_token_map=token_map)
    depth = 2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g)
            if name.endswith(("norm.weight", "_scale", "q_weight", "k_weight")):
                p.fill_(1.0)
            elif name.endswith(("_base", "attn_sink", "gate.bias", "gate.bias_vl")):
                p.zero_()
            elif name == "embed.weight" or "engram.embed" in name:
                p.copy_(x)
            elif name.endswith("markov_head.embed.weight"):
                p.copy_(0.02 * x)
            elif name.endswith("_fn"):
                p.copy_(0.5 * x / math.sqrt(p.shape[1]))
            elif name == "head.weight":  # logits start near uniform
                p.copy_(0.2 * x / math.sqrt(p.shape[1]))
            elif name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
                p.copy_(0.02 * x)
            elif p.dim() == 2:
                s = 1 / math.sqrt(p.shape[1])
                if name.endswith(("wo_b.weight", "w2.weight")) or "engram.wkv" in name:
                    s /= math.sqrt(depth)
                p.copy_(s * x)
            else:
                p.copy_(0.1 * x)
    return model


class RouterBalance:
    """Auxiliary-loss-free balancing (noaux_tc): count each gate's expert picks during a step,
    then move its selection bias by ``rate`` against the sign of (load - mean load)."""

    def __init__(self, modules: list[Gate], rate: float) -> None:
        self.rate = rate
        self.counts: dict[Gate, torch.Tensor] = {}
        self.hooks = [m.register_forward_hook(self._hook) for m in modules if m.bias is not None]

    def _hook(self, gate: Gate, _inp, out) -> None:
        ids = out[0].reshape(-1)
        n = torch.bincount(ids, minlength=gate.weight.shape[0]).float()
        self.counts[gate] = self.counts.get(gate, 0) + n

    @torch.no_grad()
    def update(self) -> float:
        """Apply and reset; -> the max over gates of max load / mean load of the step."""
        worst = 0.0
        for gate, n in self.counts.items():
            gate.bias.add_(-self.rate * torch.sign(n - n.mean()))
            worst = max(worst, float(n.max() / n.mean().clamp_min(1)))
        self.counts.clear()
        return worst

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _optimizer(params: list[tuple[str, torch.nn.Parameter]], lr: float, device: str):
    decay = [p for n, p in params if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in params if not (p.dim() == 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    fused = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def _lr(frac: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warm-up over ``warmup`` of the run, then cosine to 10% of ``peak``."""
    if frac < warmup:
        return peak * max(frac / warmup, 0.01)
    t = min((frac - warmup) / (1 - warmup), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class Budget:
    """Progress of a run sized by steps (``steps``) or by wall time (``seconds``)."""

    def __init__(self, steps: int | None, seconds: float, cap: int | None = None) -> None:
        self.steps, self.seconds, self.t0, self.done = steps, seconds, time.time(), 0
        self.cap = cap  # a wall-time run ends after at most this many steps

    def frac(self) -> float:
        if self.steps is not None:
            return self.done / max(self.steps, 1)
        t = (time.time() - self.t0) / self.seconds
        return max(t, self.done / self.cap) if self.cap else t

    def more(self) -> bool:
        return self.frac() < 1.0


# ---- training -----------------------------------------------------------------------------


def lm_loss(model: DeepseekModel, seq: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one packed sequence [L + 1] (reference forward)."""
    logits = reference_logits(model, seq[:-1])
    return torch.nn.functional.cross_entropy(logits, seq[1:])


@torch.no_grad()
def heldout_nll(
    model: DeepseekModel, docs: list[list[int]], length: int, device: str, max_tokens: int
) -> tuple[float, int]:
    """Mean NLL (nats) of the held-out documents, concatenated and cut into chunks of
    ``length`` + 1 tokens (each chunk predicts its last ``length``), up to ``max_tokens``."""
    flat = [t for d in docs for t in d][: max_tokens + 1]
    total, n = 0.0, 0
    for i in range(0, len(flat) - 1, length):
        seq = torch.tensor(flat[i : i + length + 1], device=device)
        if seq.numel() < 2:
            break
        logits = reference_logits(model, seq[:-1])
        total += float(torch.nn.functional.cross_entropy(logits, seq[1:], reduction="sum"))
        n += seq.numel() - 1
    return total / max(n, 1), n


def unigram_nll(
    train: list[list[int]], docs: list[list[int]], vocab: int, length: int, max_tokens: int
) -> float:
    """Add-one unigram of the training tokens, on the targets :func:`heldout_nll` scores."""
    counts = torch.bincount(torch.tensor([t for d in train for t in d]), minlength=vocab)
    logp = torch.log((counts.double() + 1) / (counts.sum() + vocab))
    flat = [t for d in docs for t in d][: max_tokens + 1]
    targets = [
        flat[j]
        for i in range(0, len(flat) - 1, length)
        for j in range(i + 1, min(i + length + 1, len(flat)))
    ]
    return float(-logp[torch.tensor(targets)].mean())


def dspark_batch(model: DeepseekModel, seq: torch.Tensor, n_anchors: int, gen: torch.Generator):
    """Target side of one DSpark step on ``seq`` [L] (no grad): target features [L, 3d],
    target logits [L, V], and anchors a (block rows at a+1 .. a+5 all inside ``seq``)."""
    feats: list[torch.Tensor] = []
    with torch.no_grad():
        logits = reference_logits(model, seq, features=feats)
    B = model.cfg.dspark_block_size
    hi = seq.numel() - B - 1  # a + 1 + (B - 1) + 1 <= L - 1: the target logit of each row exists
    a = torch.randperm(hi, generator=gen)[:n_anchors].sort().values.to(seq.device)
    return feats[0], logits, a


def dspark_loss(
    drafter: DSparkDrafter,
    seq: torch.Tensor,
    feats: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.Tensor,
):
    """Distillation loss of the DSpark stages at ``anchors`` through the engine's drafter.

    Context: stage KV of positions <= a from the target features (``context_kv``, laid into
    one ring slot per anchor). Block: [bonus = seq[a+1], noise x 4]; row k proposes the token
    at a+2+k, its Markov input the token at a+1+k (teacher-forced with ``seq``). Target: the
    target's softmax at a+1+k. -> (KL loss, confidence BCE, greedy agreement per row [B])."""
    W, B, R = drafter.window, drafter.block, anchors.numel()
    dev = seq.device
    pos = torch.arange(seq.numel(), device=dev)
    kvs = drafter.context_kv(feats, pos)
    j = torch.arange(W, device=dev)
    q = anchors.unsqueeze(1) - (anchors.unsqueeze(1) - j).remainder(W)  # ring row j holds q
    rings = [
        KVRows(kv[q.clamp_min(0)].reshape(R * W, -1), None, "float", kv.shape[-1]) for kv in kvs
    ]
    rows = anchors.unsqueeze(1) + 1 + torch.arange(B, device=dev)  # [R, B] positions a+1+k
    forced = seq[rows + 1]  # token at a+2+k: the Markov input of row k+1
    slots = torch.arange(R, device=dev)
    block = drafter.draft(
        rings, slots, anchors, seq[anchors + 1], B, pick=lambda k, z: forced[:, k]
    )
    z = block.logits.float()  # [R, B, V]
    target = logits[rows].float().log_softmax(-1)  # [R, B, V]
    logq = z.log_softmax(-1)
    kl = (target.exp() * (target - logq)).sum(-1).mean()
    right = (z.argmax(-1) == target.argmax(-1)).float()  # [R, B]
    conf = block.confidence.float().clamp(1e-6, 1 - 1e-6)
    bce = torch.nn.functional.binary_cross_entropy(conf, right)
    return kl, bce, right.mean(0)


def _train_target(model, stream, size, args, record, log):
    params = [(n, p) for n, p in model.named_parameters() if not n.startswith("mtp.")]
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("mtp.") and not n.endswith(("gate.bias", "bias_vl")))
    params = [(n, p) for n, p in params if p.requires_grad]
    opt = _optimizer(params, size.lr, args.device)
    balance = RouterBalance(
        [m for n, m in model.named_modules() if isinstance(m, Gate) and not n.startswith("mtp.")],
        1e-3,
    )
    cap = int(args.max_epochs * stream.tokens_per_epoch / size.seq_len)
    budget = Budget(args.steps, args.minutes * 60 * 0.8, cap)
    losses, t0 = [], time.time()
    while budget.more():
        lr = _lr(budget.frac(), size.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        seq = torch.tensor(stream.next(), device=args.device)
        loss = lm_loss(model, seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        imb = balance.update()
        budget.done += 1
        v = float(loss.detach())
        if not math.isfinite(v):
            raise RuntimeError(f"loss became {v} at step {budget.done}")
        losses.append(v)
        if budget.done % args.log_every == 0 or budget.done == 1:
            log(
                f"target step {budget.done} loss {v:.3f} lr {lr:.2e} |g| {float(gn):.2f} "
                f"load max/mean {imb:.2f} epoch {stream.epoch} {time.time() - t0:.0f}s"
            )
    balance.close()
    record["target"] = {
        "steps": budget.done,
        "seconds": round(time.time() - t0, 1),
        "tokens": budget.done * size.seq_len,
        "losses": losses,
        "epochs": round(budget.done * size.seq_len / stream.tokens_per_epoch, 2),
    }


def _train_dspark(model, stream, size, args, record, log):
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("mtp.") and not n.endswith(("gate.bias", "bias_vl")))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = _optimizer(params, size.dspark_lr, args.device)
    balance = RouterBalance(
        [m for n, m in model.named_modules() if isinstance(m, Gate) and n.startswith("mtp.")], 1e-3
    )
    drafter = DSparkDrafter(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    budget = Budget(args.dspark_steps, args.minutes * 60 * 0.2)
    losses, agree, t0 = [], [], time.time()
    while budget.more():
        lr = _lr(budget.frac(), size.dspark_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        seq = torch.tensor(stream.next(), device=args.device)
        feats, logits, anchors = dspark_batch(model, seq, size.dspark_anchors, gen)
        kl, bce, right = dspark_loss(drafter, seq, feats, logits, anchors)
        opt.zero_grad(set_to_none=True)
        (kl + 0.1 * bce).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        balance.update()
        budget.done += 1
        kl_v, bce_v = float(kl.detach()), float(bce.detach())
        losses.append(kl_v)
        agree.append([round(float(x), 4) for x in right])
        if budget.done % args.log_every == 0 or budget.done == 1:
            log(
                f"dspark step {budget.done} kl {kl_v:.3f} bce {bce_v:.3f} greedy "
                f"agreement per row {[round(float(x), 2) for x in right]} "
                f"{time.time() - t0:.0f}s"
            )
    balance.close()
    for p in model.parameters():
        p.requires_grad_(False)
    record["dspark"] = {
        "steps": budget.done,
        "seconds": round(time.time() - t0, 1),
        "kl": losses,
        "greedy_agreement_per_row": agree,
    }


@torch.no_grad()
def greedy(model: DeepseekModel, prompt: list[int], n: int, eos: int = 1) -> list[int]:
    """``n`` greedy tokens after ``prompt`` by the full-sequence reference (stops at eos)."""
    ids = list(prompt)
    dev = model.embed.weight.device
    for _ in range(n):
        nxt = int(reference_logits(model, torch.tensor(ids, device=dev))[-1].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt) :]


def export(model: DeepseekModel, raw: dict, tok, out: Path) -> Path:
    """The official-layout checkpoint of ``model`` through ``app.model.tiny``'s writer."""
    from app.model.tiny import write_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(tok, out)
    values = ((n, t.detach().float().cpu()) for n, t in model.state_dict().items())
    return write_checkpoint(out, raw, values)


def _chat_prompts(records: list[dict]) -> list[str]:
    """Held-out questions (their documents were not trained on) plus two greetings."""
    qs = []
    for r in records:
        if r["kind"] == "chat" and r["split"] == "heldout" and "<think>" not in r["text"]:
            q = r["text"].split(demo_data.USER, 1)[1].split(demo_data.ASSISTANT, 1)[0]
            qs.append(q)
    return ["Hello", "What is the assert statement?", *qs[:6]]


def check_export(model, path: Path, tok, records, enc, size, args, record, log) -> None:
    """Reload the export with the project's loader and measure what quantization changed."""
    from app.model.loader import load_model

    # loaded on the CPU (pure torch, no kernel of the device's), then moved like the model
    loaded = load_model(path, device="cpu", packed_experts=False).to(args.device)
    prompts = _chat_prompts(records)[: args.chat_prompts]
    rel, same, rows = [], 0, []
    for q in prompts:
        ids = tok.encode(demo_data.render_prompt(q)).ids
        t = torch.tensor(ids, device=args.device)
        with torch.no_grad():
            a, b = reference_logits(model, t), reference_logits(loaded, t)
        rel.append(float((a - b).abs().max() / a.abs().max()))
        ga, gb = greedy(model, ids, args.answer_tokens), greedy(loaded, ids, args.answer_tokens)
        same += ga == gb
        rows.append({"question": q, "trained": tok.decode(ga), "exported": tok.decode(gb)})
    nll_q, n = heldout_nll(loaded, enc["text_heldout"], size.seq_len, args.device, args.eval_tokens)
    record["export"] = {
        "path": str(path),
        "bytes": sum(f.stat().st_size for f in path.iterdir()),
        "logits_max_rel_diff": rel,
        "greedy_answers_identical": f"{same}/{len(prompts)}",
        "heldout_ppl_exported": math.exp(nll_q),
        "answers": rows,
    }
    log(
        f"export {path}: {record['export']['bytes'] / 2**20:.2f} MiB, logits rel diff "
        f"max {max(rel):.3f}, greedy answers identical {same}/{len(prompts)}, held-out ppl "
        f"{math.exp(nll_q):.2f}"
    )
    for r in rows[:3]:
        log(f"  Q: {r['question']!r}\n  A: {r['exported']!r}")


def train(args) -> dict:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = (out / "train_log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    def save(record: dict) -> None:
        (out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
        write_loss_png(record, out / "loss.png")

    size = SIZES[args.config]
    if args.seq_len:
        size = replace(size, seq_len=args.seq_len)
    t_start = time.time()
    records, source = demo_data.load_records(args.data)
    if args.data_limit:  # every k-th record (tests)
        records = records[:: max(1, len(records) // args.data_limit)]
    train_texts = [r["text"] for r in records if r["split"] == "train"]
    tok = train_tokenizer(train_texts, size.vocab)
    enc = encode_records(tok, records)
    token_map, n_comp = compressed_token_map(tok)
    raw = demo_config(size, n_comp, tok.token_to_id(NOISE_TOKEN))
    cfg = ModelConfig.from_dict(raw)
    model = init_model(cfg, token_map, args.seed).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    stream = Stream(enc["text_train"], enc["chat_train"], size.seq_len, args.seed)
    record: dict = {
        "name": NAME,
        "config": args.config,
        "size": asdict(size),
        "seed": args.seed,
        "device": args.device,
        "torch": torch.__version__,
        "data": source,
        "parameters": n_params,
        "parameters_dspark": n_mtp,
        "train_tokens_per_epoch": stream.tokens_per_epoch,
        "heldout_text_tokens": sum(len(d) for d in enc["text_heldout"]),
        "corpus_licence": "PSF License Version 2 (Python documentation and stdlib docstrings)",
    }
    log(
        f"{NAME} ({args.config}): {n_params / 1e6:.2f}M parameters ({n_mtp / 1e6:.2f}M DSpark), "
        f"{stream.tokens_per_epoch} training tokens per epoch, data {source}, "
        f"setup {time.time() - t_start:.1f}s"
    )
    ctx = reference_kernels() if args.device.startswith("cuda") else contextlib.nullcontext()
    with ctx:
        model.train()
        _train_target(model, stream, size, args, record, log)
        nll, n = heldout_nll(
            model, enc["text_heldout"], size.seq_len, args.device, args.eval_tokens
        )
        uni = unigram_nll(
            enc["text_train"] + enc["chat_train"],
            enc["text_heldout"],
            size.vocab,
            size.seq_len,
            args.eval_tokens,
        )
        record["heldout"] = {
            "tokens": n,
            "ppl": math.exp(nll),
            "unigram_ppl": math.exp(uni),
            "nll": nll,
            "unigram_nll": uni,
        }
        log(
            f"held-out ({n} tokens of documents not trained on): perplexity {math.exp(nll):.2f}"
            f", unigram baseline {math.exp(uni):.2f}"
        )
        save(record)
        _train_dspark(model, stream, size, args, record, log)
        model.eval()
        path = export(model, raw, tok, out / NAME)
        save(record)  # a run stopped during the checks keeps its model and record
        check_export(model, path, tok, records, enc, size, args, record, log)
    record["total_seconds"] = round(time.time() - t_start, 1)
    save(record)
    log(f"done in {record['total_seconds']}s: {out / 'train_record.json'}, {out / 'loss.png'}")
    return record


# ---- engine evaluation (CPU) --------------------------------------------------------------


def evaluate(path: Path, n_prompts: int, max_tokens: int, out: Path | None) -> dict:
    """The exported model through the engine: greedy chat answers (beside the reference
    forward of the loaded model), DSpark mean acceptance length at k = 3, 5, greedy and T=1."""
    from app.engine.llm import LLM
    from app.engine.request import SamplingParams

    records, _ = demo_data.load_records(None)
    prompts = _chat_prompts(records)[:n_prompts]
    plain = LLM(model=str(path))
    tok = plain.tokenizer
    ids = [tok.encode(demo_data.render_prompt(q)).ids for q in prompts]
    res: dict = {"model": str(path), "prompts": prompts, "max_tokens": max_tokens}
    outs = plain.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    ref = [greedy(plain.engine.model, p, max_tokens) for p in ids]
    res["answers"] = [
        {"question": q, "answer": o.text, "finish": o.finish_reason}
        for q, o in zip(prompts, outs, strict=True)
    ]
    res["engine_equals_reference"] = sum(
        list(o.token_ids) == r[: len(o.token_ids)] for o, r in zip(outs, ref, strict=True)
    )
    del plain
    res["dspark"] = []
    for k in (3, 5):
        for temp in (0.0, 1.0):
            llm = LLM(model=str(path), speculative={"method": "dspark", "num_draft_tokens": k})
            sp = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0)
            outs = llm.generate(prompt_token_ids=ids, sampling_params=sp)
            rep = llm.engine.stats.report()
            row = {
                "num_draft_tokens": k,
                "temperature": temp,
                "mean_acceptance_length": rep.get("spec_accept_length"),
                "acceptance": rep.get("spec_acceptance"),
                "verifies": rep.get("spec_verifies"),
                "accepted_at": [rep.get(f"spec_accepted_at_{j}") for j in range(1, k + 1)],
                "tokens": sum(len(o.token_ids) for o in outs),
            }
            if temp == 0:
                row["same_tokens_as_plain"] = sum(
                    list(o.token_ids) == r[: len(o.token_ids)]
                    for o, r in zip(outs, ref, strict=True)
                )
            res["dspark"].append(row)
            print(json.dumps(row), flush=True)
            del llm
    if out is not None:
        out.write_text(json.dumps(res, indent=1) + "\n")
    return res


# ---- PNG (no matplotlib) ------------------------------------------------------------------

_DIGITS = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "k": "100101110101101",
}  # fmt: skip


def _png(path: Path, px: list[bytearray], w: int, h: int) -> None:
    raw = b"".join(b"\x00" + bytes(row) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        c = struct.pack(">I", len(data)) + tag + data
        return c + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def write_loss_png(record: dict, path: Path, w: int = 720, h: int = 420) -> None:
    """Training loss per step (target: blue; DSpark KL after it: green; held-out perplexity's
    log: red line) on a grid of integer losses; x ticks in steps (k = thousands)."""
    target = record["target"]["losses"]
    dspark = record.get("dspark", {}).get("kl", [])
    px = [bytearray(b"\xff" * (3 * w)) for _ in range(h)]
    L, R, T, B = 40, w - 10, 10, h - 30
    n = len(target) + len(dspark)
    top = max(1.0, math.ceil(max(target[: max(1, len(target))] + dspark + [1.0])))
    top = min(top, 12.0)

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            px[y][3 * x : 3 * x + 3] = bytes(c)

    def text(s: str, x: int, y: int) -> None:
        for ch in s:
            g = _DIGITS.get(ch)
            if g:
                for i, bit in enumerate(g):
                    if bit == "1":
                        for dx in range(2):
                            for dy in range(2):
                                put(x + 2 * (i % 3) + dx, y + 2 * (i // 3) + dy, (0, 0, 0))
            x += 8

    def X(i: float) -> int:
        return L + int((R - L) * i / max(n - 1, 1))

    def Y(v: float) -> int:
        return B - int((B - T) * min(max(v, 0.0), top) / top)

    for v in range(int(top) + 1):
        for x in range(L, R):
            put(x, Y(v), (225, 225, 225))
        text(str(v), L - 12, Y(v) - 5)
    for y in range(T, B + 1):
        put(L, y, (0, 0, 0))
    for x in range(L, R + 1):
        put(x, B, (0, 0, 0))
    step = 10 ** max(0, len(str(max(n, 1))) - 1)
    for i in range(0, n, step):
        for y in range(B, B + 4):
            put(X(i), y, (0, 0, 0))
        text(f"{i // 1000}k" if i >= 1000 else str(i), X(i) - 6, B + 8)

    def curve(vals: list[float], off: int, c: tuple[int, int, int]) -> None:
        k = max(1, len(vals) // 200)  # moving average of ~0.5% of the run
        prev = None
        for i in range(len(vals)):
            lo = max(0, i - k + 1)
            v = sum(vals[lo : i + 1]) / (i + 1 - lo)
            p = (X(off + i), Y(v))
            if prev is not None:
                steps = max(abs(p[0] - prev[0]), abs(p[1] - prev[1]), 1)
                for s in range(steps + 1):
                    put(
                        prev[0] + (p[0] - prev[0]) * s // steps,
                        prev[1] + (p[1] - prev[1]) * s // steps,
                        c,
                    )
            prev = p

    curve(target, 0, (30, 80, 200))
    curve(dspark, len(target), (30, 150, 60))
    if "heldout" in record:
        y = Y(record["heldout"]["nll"])
        for x in range(L, X(len(target) - 1), 3):
            put(x, y, (200, 40, 40))
    _png(path, px, w, h)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(SIZES), default="shipped")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, help="output directory (the model in OUT/tiny-v41-chat)")
    ap.add_argument("--data", type=Path, default=None, help="prepared corpus (tools/demo_data)")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-time budget of training")
    ap.add_argument("--steps", type=int, default=None, help="target steps (overrides minutes)")
    ap.add_argument("--dspark-steps", type=int, default=None)
    ap.add_argument("--max-epochs", type=float, default=20.0, help="cap of a wall-time run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (override)")
    ap.add_argument("--data-limit", type=int, default=None, help="use about N records (tests)")
    ap.add_argument("--chat-prompts", type=int, default=8, help="prompts of the export check")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-tokens", type=int, default=65536, help="held-out tokens scored")
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--evaluate", type=Path, default=None, help="engine-evaluate an export")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args(argv)
    if args.evaluate is not None:
        out = args.out / "eval_record.json" if args.out else args.evaluate / "eval_record.json"
        evaluate(args.evaluate, args.prompts, args.answer_tokens, out)
        return
    if args.out is None:
        ap.error("--out is required")
    if args.steps is not None and args.dspark_steps is None:
        args.dspark_steps = max(1, args.steps // 4)
    train(args)


if __name__ == "__main__":
    main()
