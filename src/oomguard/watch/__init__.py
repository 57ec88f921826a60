"""``oomguard watch``: follow running vLLM servers against their plan, and alert before they fail.

Modules: ``rules`` (the alerts and their thresholds, shared with the Prometheus rules in
``deploy/``), ``sampling`` (``/metrics``, NVML, host memory), ``evaluate`` (samples → rule
observations), ``alerts`` (pending/firing/resolved with hysteresis), ``leak`` (robust slope),
``sinks`` (JSON lines, Alertmanager webhooks), ``exporter`` (the watcher's own ``/metrics``),
``view`` (the terminal), ``runner`` (the loop) and ``cli``.
"""
