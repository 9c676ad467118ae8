"""What each cut of the memory order costs: the cost column of `grpokit plan-memory`
(grpokit.train.memory.plan); the two measured figures come from `make bench-costs` (bench/costs.py)."""

CKPT_SLOWDOWN = 0.23        # measured: forward + backward, 8.4 M params, 16 x 256 tokens, 2 CPU threads
FOUR_BIT_DLOGP = 0.047      # measured: mean |log p(NF4) - log p(float32)| per token, 4.2 M params
COSTS = {
    "gradient checkpointing": f"update +{CKPT_SLOWDOWN:.0%} time (one more forward per layer; measured here: "
                              "8.4 M params, 16 x 256 tokens, 2 CPU threads)",
    "LoRA": "trains rank-r adapters only: less capacity than all weights; lr 1e-4 to 2e-4",
    "4-bit": f"log-probs off by {FOUR_BIT_DLOGP} nats/token on average, p99 0.29 (NF4 vs float32, 4.2 M params, "
             "measured here): noise in the ratio and the KL",
    "reference offload": "the reference pass runs at CPU speed every step (the KL term's forward)",
    "smaller G": "fewer samples per prompt: more all-equal groups, noisier advantages",
    "micro-batch": "more, smaller passes: slower, same result",
    "fixed rounds": "a step's groups over up to max_sampling_rounds thin generations instead of one wide one: slower",
}
"""What each cut of the memory order costs (the practitioner's rule R6 names them: checkpointing is
slower, LoRA loses some capacity, 4-bit can hurt log-prob precision, CPU offload slows the KL), with
this machine's measurements where one was made (docs/memory.md, "What each cut costs")."""
