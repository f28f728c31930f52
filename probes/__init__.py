"""eBPF probes, one tool per module in the bcc tools' manner (installed as `wedgectl.probes`)."""
