"""What the report advises for each failed check: its likely cause and the setting to change
(docs/next-steps.md says the same at length). Pure data."""

ADVICE = {
    "contract": "the trajectories break the rollout contract (identities, complete groups): "
                "a bug or tampering; run again and report it if it repeats",
    "execution": "no optimizer step happened: no group had reward variance; raise group_size "
                 "or temperature, or choose task params the baseline solves 10-60 % of",
    "effective_groups": "too few groups had reward variance: raise group_size (G) or "
                        "temperature, or choose task params the baseline solves 10-60 % of",
    "effective_throughput": "training was slower than the gate: lower max_new_tokens, raise "
                            "generation_batch_size, or run on a GPU (--device cuda)",
    "updates": "too few optimizer steps: train longer (--steps)",
    "reward": "the re-test mean reward did not gain enough: train longer (--steps), try a "
              "higher --lr (e.g. 1e-4); if the gain was not shown (not ruled out), raise eval_prompts: "
              "extending the re-test keeps its error rate",
    "pass_at_group": "pass@k did not gain enough: train longer or with a higher --lr; more "
                     "eval_prompts narrow its bounds",
    "truncation": "too many training completions hit the token budget: raise --max-new-tokens "
                  "or ask for shorter answers (system_prompt)",
    "length_budget": "too many re-test completions hit the token budget, so the gain is "
                     "measured on cut-off answers: raise --max-new-tokens",
    "guard": "the re-test did not show the candidate within gates.maximum_guard_reward_loss of "
             "the baseline on the guard set (a neighbouring task): if a loss beyond it was "
             "shown, the update damaged what it was not trained on (lower --lr, raise beta, "
             "train fewer steps; see guard_completions.jsonl); if non-inferiority was only not "
             "shown, raise guard.rounds (extending the re-test keeps its error rate)",
    "retest_kl": "the candidate moved further from the baseline than the KL gate allows: "
                 "raise beta, lower --lr or train fewer steps",
    "effective_update": "the candidate answers the re-test exactly as the baseline does: the "
                        "update changed nothing measurable; raise --lr or train more steps",
    "finite_weights": "the candidate's weights hold NaN or infinite values (what a diverged "
                      "training run leaves): it was not re-tested; take an earlier checkpoint "
                      "or train again with a lower learning rate",
    "finite_retest": "the candidate's re-test gave NaN or infinite entropies or KL (its logits "
                     "overflow): it computes no usable distribution; take an earlier checkpoint",
    "retest_stopping": "the stored re-test holds more or fewer prompts or guard rounds than its "
                       "stopping rule takes: the run directory was edited or cut; do not deliver "
                       "it, run the re-test again",
    "memory": "peak memory above the gate: lower micro_batch_size or generation_batch_size",
    "artifact": "the adapter is missing or does not hash as recorded: do not deliver this "
                "directory; run again",
}
