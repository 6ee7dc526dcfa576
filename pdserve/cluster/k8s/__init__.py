"""`pdserve k8s render`: a cluster file rendered as Kubernetes manifests (Deployments or
LeaderWorkerSets, InferencePool, KEDA, monitoring, TLS, NetworkPolicies)."""
