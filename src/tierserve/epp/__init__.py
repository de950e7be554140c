"""`tierserve epp`: the fleet gateway as an Endpoint Picker behind Envoy (the Gateway API
Inference Extension's ext_proc protocol). service.py answers Envoy, handoff.py is the
fleet backend's transport when Envoy moves the bytes, envoy.py writes a bootstrap for a
gateway without Kubernetes. Torch-free, as the gateway is."""
