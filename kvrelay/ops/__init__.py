"""What only the daemon uses: configuration, lifecycle, metrics, systemd notification, TLS.

Nothing below ``ops`` imports it: the relay core, the gRPC service and the SDK run without a
config file, a metrics endpoint or systemd.
"""
