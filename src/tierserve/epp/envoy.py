"""An Envoy bootstrap for `tierserve epp` without Kubernetes: one listener whose requests
the picker places on the replicas (`tierserve epp --print-envoy-config`), or, for
comparison, Envoy's own round-robin over the same replicas (`picker=False`).

NOTE: the choices written here
    - The replicas are one STATIC cluster with Envoy's `override_host` load-balancing
      policy: it sends a request to the endpoint the picker named (header
      `x-gateway-destination-endpoint`, or the same key in the `envoy.lb` metadata), and
      on a retry to the next endpoint of that list; a request the picker named no
      endpoint for (not a completion, or the picker failing open) goes round-robin.
    - Retries: a replica that cannot be reached or resets before answering is retried
      on the next endpoint, up to one per other replica (`connect-failure`,
      `refused-stream`, `reset`); Envoy never retries once the answer started.
    - Two ext_proc filters on the picker's one gRPC service. The first picks: request
      headers and the whole request body (BUFFERED: the picker reads the body to pick);
      the ids it sets on the request come back on the response by the route's
      `response_headers_to_add` (`x-request-id`, `x-tierserve-served-tier`, and
      `x-tierserve-endpoint`, the endpoint that answered). The second meters,
      in observability mode, which Envoy does not wait for: the request headers (the
      request id the first set) and the response as it streams, so no token waits on
      the picker. `upstream.address` comes with its response headers, so the picker
      learns which endpoint answered.
    - Failure mode: closed by default (`failure_mode_allow: false`; Envoy answers 500
      while the picker is down, as the Inference Extension's default FailClose); with
      `fail_open` requests go round-robin, untiered and unmetered, while it is down.
    - `message_timeout` is long: the picker holds a request's stream while it waits in
      its tier's queue (flex waits up to its limit, 60 s by default).
"""

import yaml

EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
       "HttpConnectionManager")
OVERRIDE = ("type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3."
            "OverrideHost")
ROUND_ROBIN = ("type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3."
               "RoundRobin")
DESTINATION = "x-gateway-destination-endpoint"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _round_robin() -> dict:
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": ROUND_ROBIN}}}]}


def bootstrap(endpoints: list[tuple[str, int]], listen: tuple[str, int],
              picker: tuple[str, int] | None, admin: tuple[str, int] | None = None,
              fail_open: bool = False, message_timeout_s: float = 300.0) -> dict:
    """Envoy's bootstrap: `listen` in front of `endpoints`, through the picker at
    `picker` (None: Envoy's round-robin alone)."""
    pool = {"name": "pool", "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}]}}
    route = {"cluster": "pool", "timeout": "0s"}
    filters = []
    clusters = [pool]
    if picker is None:
        pool["load_balancing_policy"] = _round_robin()
    else:
        pool["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {"@type": OVERRIDE,
                             "override_host_sources": [
                                 {"header": DESTINATION},
                                 {"metadata": {"key": "envoy.lb",
                                               "path": [{"key": DESTINATION}]}}],
                             "fallback_policy": _round_robin()}}}]}
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset",
                                 "num_retries": max(1, len(endpoints) - 1)}
        # what names the answer's ledger row and where it ran, from what the picker set on
        # the request and the endpoint Envoy used (no round trip to the picker for it)
        response_headers = [
            {"header": {"key": key, "value": value}, "keep_empty_value": False,
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in (("x-request-id", "%REQ(x-tierserve-request-id)%"),
                               ("x-tierserve-served-tier", "%REQ(x-tierserve-served-tier)%"),
                               ("x-tierserve-endpoint", "%UPSTREAM_HOST%"))]
        timeout = f"{message_timeout_s:g}s"
        grpc = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": timeout}
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": EXT_PROC, "grpc_service": grpc,
            "failure_mode_allow": bool(fail_open),
            "message_timeout": timeout, "max_message_timeout": timeout,
            "processing_mode": {"request_header_mode": "SEND",
                                "response_header_mode": "SKIP",
                                "request_body_mode": "BUFFERED",
                                "response_body_mode": "NONE",
                                "request_trailer_mode": "SKIP",
                                "response_trailer_mode": "SKIP"}}})
        filters.append({"name": "envoy.filters.http.ext_proc.meter", "typed_config": {
            "@type": EXT_PROC, "grpc_service": grpc, "observability_mode": True,
            "failure_mode_allow": True,  # reading the answer never stops it
            "processing_mode": {"request_header_mode": "SEND",
                                "response_header_mode": "SEND",
                                "request_body_mode": "NONE",
                                "response_body_mode": "STREAMED",
                                "request_trailer_mode": "SKIP",
                                "response_trailer_mode": "SKIP"},
            "response_attributes": ["upstream.address"]}})
        clusters.append({
            "name": "epp", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                             "HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(*picker)}}]}]}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    manager = {"@type": HCM, "stat_prefix": "inference", "http_filters": filters,
               "route_config": {"name": "inference", "virtual_hosts": [{
                   "name": "all", "domains": ["*"],
                   "routes": [{"match": {"prefix": "/"}, "route": route,
                               **({"response_headers_to_add": response_headers}
                                  if picker is not None else {})}]}]}}
    out = {"static_resources": {
        "listeners": [{"name": "inference", "address": _address(*listen),
                       "filter_chains": [{"filters": [{
                           "name": "envoy.filters.network.http_connection_manager",
                           "typed_config": manager}]}]}],
        "clusters": clusters}}
    if admin is not None:
        out["admin"] = {"address": _address(*admin)}
    return out


def dump(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)
