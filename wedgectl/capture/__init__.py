"""From a pid or URL to evidence: a deployment found, sampled over a window, and held under watch.

- `discover`: the deployment (its tree, roles, URL and log), its manifest, the model it serves;
- `options`: what a capture is asked for; `policy`: the escalation, pure;
- `tree`, `bursts`, `sample`: /proc through a kept process tree, stack dumps, one sample;
- `probing`: the eBPF probes of a capture;
- `session`: one live deployment as diagnose, top and watch all hold it;
- `window`: diagnose's window (`window.capture`, `window.fatal_problem`);
- `diagnosis`: one diagnosis, from the sources diagnose names to the verdict.
"""
