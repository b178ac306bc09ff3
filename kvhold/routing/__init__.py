"""Several sidecars as one service: the etcd registry client and the routers that move streams off a dead sidecar."""
