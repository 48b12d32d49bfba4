{{/*
Names are fixed, not derived from the release: guests' user-data names the registry
Service (imex-host-agent.<namespace>.svc), the admission policy matches the account
imex-host-agent, and the Lease and CA Secrets are found by name. One release per
cluster (the CRD and the ClusterRoles are cluster-wide).
*/}}

{{/* Labels of every object: the manifests' own two, then Helm's standard ones
(tools/chart_manifests strips these four when it writes manifests/agent). */}}
{{- define "imex-ensemble.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: imex-ensemble
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{- end }}

{{- define "imex-ensemble.agentLabels" -}}
{{ include "imex-ensemble.labels" (dict "name" "imex-host-agent" "ctx" .) }}
{{- end }}

{{/* The Deployment's selector: immutable, and the same as the kustomize install's, so
that Helm can take that Deployment over. */}}
{{- define "imex-ensemble.selectorLabels" -}}
app.kubernetes.io/name: imex-host-agent
{{- end }}

{{- define "imex-ensemble.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* What the agent may do wherever it watches: the ClusterRole's rules, or each
namespaced Role's. */}}
{{- define "imex-ensemble.agentRules" -}}
- apiGroups: ["kubevirt.io"]
  resources: ["virtualmachineinstances"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["imex-ensemble.io"]
  resources: ["imexensembles"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["imex-ensemble.io"]
  resources: ["imexensembles/status"]
  verbs: ["patch", "update"]
# ownerReferences with blockOwnerDeletion on the owned Services need it where
# OwnerReferencesPermissionEnforcement is on (OpenShift: always)
- apiGroups: ["imex-ensemble.io"]
  resources: ["imexensembles/finalizers"]
  verbs: ["update"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* The agent is cluster-wide unless rbac.scope is namespaced. */}}
{{- define "imex-ensemble.clusterScope" -}}
{{- if eq .Values.rbac.scope "cluster" }}true{{ end }}
{{- end }}
