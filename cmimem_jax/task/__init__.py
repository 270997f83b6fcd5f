"""The CMI-Mem task: what one GRPO step of CMI-Mem does, in one place.

`episode` (the session `C_t` with its state `M_{t-1}`, its policy prompt,
applying and scoring a group of rollouts), `qa_reward` (`r_QA`),
`curriculum` (Eq. 14), `snapshots` (the states, built and refreshed by the
policy), `loop` (the training loop wiring memory + cmi + rl), and
`build_memory` (banks built by a policy, scored and probed).
"""
