"""After a run: re-check and hand it on. `replay` regenerates re-test completions for
`grpogate decide --replay`, `signing` signs a finished run and verifies the signature,
`standalone_eval` evaluates one policy alone and pairs two evaluations (`grpogate eval` /
`compare`)."""
