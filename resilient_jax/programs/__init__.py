"""A stage's compiled programs: F, B, W (and fused BW), the optimizer step and the gradient
reduction's (`stages`), each compiled once and loaded on every device that runs it
(`compiled`), once per cache folder across processes (`compile_claims`)."""
