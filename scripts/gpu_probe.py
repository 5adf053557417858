"""Quick GPU probe: step time of HFMegaTrainer on a real-size random-init config (dev tool).

python3 scripts/gpu_probe.py --hidden 1536 --inter 8960 --layers 28 --heads 12 --kv 2 --vocab 151936 \
    --seq 4096 --micro 4 --ga 1 --steps 4
"""

import argparse
import json
import os
import resource
import time

import torch
from transformers import Qwen2Config, TrainerCallback

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.hf.loading import AutoModelForCausalLM  # noqa: F401


def main():
    p = argparse.ArgumentParser()
    for k, d in dict(hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, seq=4096,
                     micro=4, ga=1, steps=4).items():
        p.add_argument(f"--{k}", type=int, default=d)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv, max_position_embeddings=32768,
                      tie_word_embeddings=a.hidden < 2048, rope_theta=1e6)
    t0 = time.time()
    from accelerate import init_empty_weights  # noqa
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, a.vocab, (a.seq,), generator=g)), "labels": ids}
            for _ in range(a.micro * a.ga * (a.steps + 1))]
    args = MegaTrainArguments(output_dir="/tmp/probe", per_device_train_batch_size=a.micro,
                              gradient_accumulation_steps=a.ga, max_steps=a.steps, bf16=True,
                              logging_steps=1, report_to=[], save_strategy="no",
                              disable_tqdm=True, learning_rate=1e-5, dataloader_num_workers=0)
    trainer = HFMegaTrainer(model=model, args=args, train_dataset=data)
    t_init = time.time() - t0
    times = []

    opt_times = []

    class T(TrainerCallback):
        def on_step_begin(self, *x, **k):
            torch.cuda.synchronize(); self.t = time.perf_counter()

        def on_pre_optimizer_step(self, *x, **k):
            torch.cuda.synchronize(); self.o = time.perf_counter()

        def on_optimizer_step(self, *x, **k):
            torch.cuda.synchronize(); opt_times.append(time.perf_counter() - self.o)

        def on_step_end(self, *x, **k):
            torch.cuda.synchronize(); times.append(time.perf_counter() - self.t)

    trainer.add_callback(T())
    trainer.train()
    tokens = a.micro * a.ga * a.seq
    med = sorted(times[1:])[len(times[1:]) // 2]
    tps = tokens / med
    res = dict(threads=torch.get_num_threads(), omp=os.environ.get('OMP_NUM_THREADS'), opt_times=opt_times, params_b=n_params / 1e9, tokens_per_step=tokens, step_times=times, median=med,
               tokens_per_s=tps, model_tflops=6 * n_params * tps / 1e12,
               peak_hbm_gib=torch.cuda.max_memory_reserved() / 2**30,
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               init_s=t_init, h2d_gb=trainer.megatrain.engine.h2d_bytes / 1e9)
    print(json.dumps(res))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
