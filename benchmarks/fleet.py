"""Fleet mode beside its replicas: gateway overhead, the fast lane under a flood, no
over-throttling, prefix affinity, two replicas vs one server, the gateway's ceiling and
the metering estimate.

    python benchmarks/fleet.py [overhead fastlane throttle affinity replicas ceiling metering]

Same as `tierserve bench fleet`; needs `make vllm-install` for the vLLM scenarios. Prints
one line per configuration.
"""

import sys

from tierserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fleet", *sys.argv[1:]]))
