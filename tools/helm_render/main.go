// helm_render renders a Helm v3 chart the way `helm template` does, without Helm.
//
// It uses the same engine Helm uses: Go's text/template with the sprig function library,
// plus Helm's own functions (include, tpl, required, fail, toYaml, fromYaml, toJson,
// fromJson, lookup) and Helm's value coalescing. It exists so the chart in charts/ can be
// rendered and checked on a machine without Helm (see README.md for what it does not do).
//
// Build without network against Debian's Go packages:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o helm_render ./tools/helm_render
//
// Usage:
//
//	helm_render [--name NAME] [--namespace NS] [-f values.yaml]... [--set a.b=c]...
//	            [--kube-version 1.31.0] [--api-versions group/version]... [--notes FILE] CHART_DIR
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/ioutil"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/Masterminds/semver"
	"github.com/Masterminds/sprig"
	"github.com/ghodss/yaml"
)

// recursionMaxNums is Helm's limit on nested `include` of one template name.
const recursionMaxNums = 1000

// ---------------------------------------------------------------------------------------
// Built-in objects: .Chart, .Release, .Capabilities, .Files, .Template
// ---------------------------------------------------------------------------------------

// Metadata is Chart.yaml. Templates see it as .Chart with Helm's field names
// (.Chart.Name, .Chart.Version, .Chart.AppVersion, ...).
type Metadata struct {
	APIVersion  string            `json:"apiVersion"`
	Name        string            `json:"name"`
	Version     string            `json:"version"`
	KubeVersion string            `json:"kubeVersion,omitempty"`
	Description string            `json:"description,omitempty"`
	Type        string            `json:"type,omitempty"`
	Keywords    []string          `json:"keywords,omitempty"`
	Home        string            `json:"home,omitempty"`
	Sources     []string          `json:"sources,omitempty"`
	Icon        string            `json:"icon,omitempty"`
	AppVersion  string            `json:"appVersion,omitempty"`
	Deprecated  bool              `json:"deprecated,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	// Not interpreted here (no subcharts): kept so Chart.yaml with them still loads.
	Dependencies []interface{} `json:"dependencies,omitempty"`
	Maintainers  []interface{} `json:"maintainers,omitempty"`
}

// Validate mirrors Helm's chart.Metadata.Validate for the fields it checks.
func (m *Metadata) Validate() error {
	if m.APIVersion == "" {
		return errors.New("chart.metadata.apiVersion is required")
	}
	if m.APIVersion != "v2" {
		return fmt.Errorf("chart.metadata.apiVersion %q is not supported here (only v2)", m.APIVersion)
	}
	if m.Name == "" {
		return errors.New("chart.metadata.name is required")
	}
	if m.Name != filepath.Base(m.Name) {
		return fmt.Errorf("chart.metadata.name %q is invalid", m.Name)
	}
	if m.Version == "" {
		return errors.New("chart.metadata.version is required")
	}
	if _, err := semver.StrictNewVersion(m.Version); err != nil {
		return fmt.Errorf("chart.metadata.version %q is invalid", m.Version)
	}
	if m.Type != "" && m.Type != "application" && m.Type != "library" {
		return errors.New("chart.metadata.type must be application or library")
	}
	if len(m.Dependencies) > 0 {
		return errors.New("chart dependencies (subcharts) are not supported by helm_render")
	}
	return nil
}

// KubeVersion is .Capabilities.KubeVersion.
type KubeVersion struct {
	Version string // "v1.31.0"
	Major   string
	Minor   string
}

func (kv *KubeVersion) String() string { return kv.Version }

// GitVersion is the deprecated alias Helm keeps.
func (kv *KubeVersion) GitVersion() string { return kv.Version }

// VersionSet is .Capabilities.APIVersions: "group/version" and "group/version/Kind".
type VersionSet []string

// Has is `.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"`.
func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

// Capabilities is .Capabilities (no .HelmVersion).
type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
}

// The built-in API versions a current cluster serves (Helm ships a similar default list).
var defaultAPIVersions = []string{
	"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v2",
	"rbac.authorization.k8s.io/v1", "networking.k8s.io/v1", "coordination.k8s.io/v1",
	"apiextensions.k8s.io/v1", "admissionregistration.k8s.io/v1", "storage.k8s.io/v1",
	"discovery.k8s.io/v1", "scheduling.k8s.io/v1", "certificates.k8s.io/v1",
}

// Files is .Files: the chart's files outside templates/ (Get, GetBytes, Glob, Lines).
type Files map[string][]byte

func (f Files) GetBytes(name string) []byte { return f[name] }
func (f Files) Get(name string) string      { return string(f[name]) }

// Lines splits a file into lines (Helm's .Files.Lines).
func (f Files) Lines(name string) []string {
	data, ok := f[name]
	if !ok {
		return []string{}
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

// Glob returns the files whose names match the pattern (path.Match, not Helm's globstar).
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

// ---------------------------------------------------------------------------------------
// Values: chart defaults, then -f files in order, then --set; Helm's coalescing rules
// ---------------------------------------------------------------------------------------

// readYAMLMap parses YAML the way Helm does (sigs.k8s.io/yaml, a fork of ghodss/yaml):
// YAML -> JSON -> Go, so numbers are float64 and keys are strings.
func readYAMLMap(data []byte, what string) (map[string]interface{}, error) {
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %v", what, err)
	}
	if out == nil {
		out = map[string]interface{}{}
	}
	return out, nil
}

// mergeMaps is Helm's mergeMaps for -f files and --set: b's values win, maps merge.
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if vm, ok := v.(map[string]interface{}); ok {
			if bv, ok := out[k]; ok {
				if bvm, ok := bv.(map[string]interface{}); ok {
					out[k] = mergeMaps(bvm, vm)
					continue
				}
			}
		}
		out[k] = v
	}
	return out
}

// coalesce merges chart defaults (src) under user values (dst), as Helm's
// chartutil.CoalesceValues does: user values win; maps merge recursively; a user value of
// null deletes the key (and its default).
func coalesce(dst, src map[string]interface{}, prefix string) map[string]interface{} {
	if dst == nil {
		dst = map[string]interface{}{}
	}
	for key, val := range src {
		full := strings.TrimPrefix(prefix+"."+key, ".")
		dv, present := dst[key]
		switch {
		case !present:
			dst[key] = copyValue(val)
		case dv == nil:
			delete(dst, key)
		default:
			dm, dIsMap := dv.(map[string]interface{})
			sm, sIsMap := val.(map[string]interface{})
			switch {
			case dIsMap && sIsMap:
				coalesce(dm, sm, full)
			case dIsMap && !sIsMap && val != nil:
				fmt.Fprintf(os.Stderr, "warning: cannot overwrite table with non table for %s (%v)\n", full, val)
			case !dIsMap && sIsMap:
				fmt.Fprintf(os.Stderr, "warning: destination for %s is a table. Ignoring non-table value (%v)\n", full, dv)
			}
		}
	}
	// Nulls the user set for keys without a default are removed as well.
	for key, val := range dst {
		if val == nil {
			delete(dst, key)
		}
	}
	return dst
}

func copyValue(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, x := range t {
			out[k] = copyValue(x)
		}
		return out
	case []interface{}:
		out := make([]interface{}, len(t))
		for i, x := range t {
			out[i] = copyValue(x)
		}
		return out
	}
	return v
}

// parseSet applies one --set a.b.c=value (a subset of Helm's strvals: no lists, no
// escaped dots, no comma-separated pairs). Values: true/false -> bool, integers ->
// int64, null -> nil (deletes), anything else a string.
func parseSet(into map[string]interface{}, expr string) error {
	eq := strings.Index(expr, "=")
	if eq <= 0 {
		return fmt.Errorf("--set %q: expected key=value", expr)
	}
	keys, raw := strings.Split(expr[:eq], "."), expr[eq+1:]
	for _, k := range keys {
		if k == "" || strings.ContainsAny(k, "[]{},") {
			return fmt.Errorf("--set %q: only dotted map keys are supported", expr)
		}
	}
	var value interface{} = raw
	switch {
	case raw == "true":
		value = true
	case raw == "false":
		value = false
	case raw == "null":
		value = nil
	default:
		if n, err := strconv.ParseInt(raw, 10, 64); err == nil && (raw == "0" || raw[0] != '0') {
			value = n
		}
	}
	node := into
	for _, k := range keys[:len(keys)-1] {
		next, ok := node[k].(map[string]interface{})
		if !ok {
			next = map[string]interface{}{}
			node[k] = next
		}
		node = next
	}
	node[keys[len(keys)-1]] = value
	return nil
}

// ---------------------------------------------------------------------------------------
// Functions: sprig (minus env/expandenv, as in Helm) plus Helm's own
// ---------------------------------------------------------------------------------------

func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return "" // Helm swallows the error the same way
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(str string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(str), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromYAMLArray(str string) []interface{} {
	a := []interface{}{}
	if err := yaml.Unmarshal([]byte(str), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func toJSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(data)
}

func fromJSON(str string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(str), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJSONArray(str string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(str), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

func required(warn string, val interface{}) (interface{}, error) {
	if val == nil {
		return val, errors.New(warn)
	}
	if s, ok := val.(string); ok && s == "" {
		return val, errors.New(warn)
	}
	return val, nil
}

func baseFuncMap() template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	extra := template.FuncMap{
		"toYaml":        toYAML,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"required":      required,
		"fail":          func(msg string) (string, error) { return "", errors.New(msg) },
		// No cluster here: lookup finds nothing, as with `helm template`, unless
		// --lookup gives the objects a cluster holds (renderAll replaces it then).
		"lookup": func(string, string, string, string) (map[string]interface{}, error) {
			return map[string]interface{}{}, nil
		},
		// Replaced per template set below.
		"include": func(string, interface{}) (string, error) { return "", nil },
		"tpl":     func(string, interface{}) (string, error) { return "", nil },
	}
	for k, v := range extra {
		f[k] = v
	}
	return f
}

func includeFun(t *template.Template, included map[string]int) func(string, interface{}) (string, error) {
	return func(name string, data interface{}) (string, error) {
		if included[name] > recursionMaxNums {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		included[name]++
		defer func() { included[name]-- }()
		var buf strings.Builder
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
}

func tplFun(parent *template.Template, included map[string]int) func(string, interface{}) (string, error) {
	return func(text string, vals interface{}) (string, error) {
		t, err := parent.Clone()
		if err != nil {
			return "", fmt.Errorf("cannot clone template: %v", err)
		}
		t.Option("missingkey=zero")
		t.Funcs(template.FuncMap{"include": includeFun(t, included), "tpl": tplFun(t, included)})
		t, err = t.New(parent.Name()).Parse(text)
		if err != nil {
			return "", fmt.Errorf("cannot parse template %q: %v", text, err)
		}
		var buf strings.Builder
		if err := t.Execute(&buf, vals); err != nil {
			return "", fmt.Errorf("error during tpl function execution for %q: %v", text, err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
}

// ---------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------

type chartFiles struct {
	meta      Metadata
	defaults  map[string]interface{}
	templates map[string]string // "<chart>/templates/x.yaml" -> text
	files     Files             // everything else, relative to the chart root
}

func loadChart(dir string) (*chartFiles, error) {
	raw, err := ioutil.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, fmt.Errorf("Chart.yaml: %v", err)
	}
	c := &chartFiles{templates: map[string]string{}, files: Files{}}
	if err := yaml.Unmarshal(raw, &c.meta); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %v", err)
	}
	if err := c.meta.Validate(); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %v", err)
	}
	c.defaults = map[string]interface{}{}
	if data, err := ioutil.ReadFile(filepath.Join(dir, "values.yaml")); err == nil {
		if c.defaults, err = readYAMLMap(data, "values.yaml"); err != nil {
			return nil, err
		}
	}
	err = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		if info.IsDir() {
			if rel == "charts" {
				return errors.New("charts/ (subcharts) is not supported by helm_render")
			}
			return nil
		}
		data, err := ioutil.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			c.templates[c.meta.Name+"/"+rel] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml" || rel == "Chart.lock" || rel == ".helmignore":
		default:
			c.files[rel] = data
		}
		return nil
	})
	return c, err
}

// sortTemplates is Helm's order for parsing: deeper paths first, then reverse
// lexicographic; it decides which `define` wins when two files define one name.
func sortTemplates(names []string) []string {
	sort.Slice(names, func(i, j int) bool {
		a, b := names[i], names[j]
		ca, cb := strings.Count(a, "/"), strings.Count(b, "/")
		if ca == cb {
			return a > b
		}
		return ca > cb
	})
	return names
}

// lookupIn is Helm's `lookup apiVersion kind namespace name` against a fixed set of
// objects (what `helm install`/`upgrade` would find in the cluster): the object as a map,
// or an empty map when there is none; with name "" a list ({"apiVersion", "kind":
// <Kind>List, "items"}); namespace "" matches every namespace, as for Helm.
func lookupIn(objects []map[string]interface{}) func(string, string, string, string) (map[string]interface{}, error) {
	return func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		items := []interface{}{}
		for _, obj := range objects {
			meta, _ := obj["metadata"].(map[string]interface{})
			objNamespace, _ := meta["namespace"].(string)
			objName, _ := meta["name"].(string)
			if obj["apiVersion"] != apiVersion || obj["kind"] != kind {
				continue
			}
			if namespace != "" && objNamespace != "" && objNamespace != namespace {
				continue
			}
			if name == "" {
				items = append(items, copyValue(obj))
			} else if objName == name {
				return copyValue(obj).(map[string]interface{}), nil
			}
		}
		if name != "" {
			return map[string]interface{}{}, nil
		}
		return map[string]interface{}{"apiVersion": apiVersion, "kind": kind + "List", "items": items}, nil
	}
}

// readObjects reads a multi-document YAML file of Kubernetes objects (for --lookup).
func readObjects(file string) ([]map[string]interface{}, error) {
	data, err := ioutil.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var out []map[string]interface{}
	for _, doc := range docSeparator.Split(string(data), -1) {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		obj, err := readYAMLMap([]byte(doc), file)
		if err != nil {
			return nil, err
		}
		if len(obj) > 0 {
			out = append(out, obj)
		}
	}
	return out, nil
}

// renderAll executes every template that is not a partial (base name starting with "_"),
// with Helm's engine settings, and returns name -> text.
func renderAll(c *chartFiles, top map[string]interface{}, cluster []map[string]interface{}) (map[string]string, error) {
	t := template.New("gotpl")
	t.Option("missingkey=zero")
	included := map[string]int{}
	funcs := baseFuncMap()
	if cluster != nil {
		funcs["lookup"] = lookupIn(cluster)
	}
	funcs["include"] = includeFun(t, included)
	funcs["tpl"] = tplFun(t, included)
	t.Funcs(funcs)
	names := make([]string, 0, len(c.templates))
	for name := range c.templates {
		names = append(names, name)
	}
	names = sortTemplates(names)
	for _, name := range names {
		if _, err := t.New(name).Parse(c.templates[name]); err != nil {
			return nil, fmt.Errorf("parse error in %s: %v", name, err)
		}
	}
	out := map[string]string{}
	for _, name := range names {
		if strings.HasPrefix(path.Base(name), "_") {
			continue
		}
		vals := map[string]interface{}{}
		for k, v := range top {
			vals[k] = v
		}
		vals["Template"] = map[string]interface{}{"Name": name, "BasePath": c.meta.Name + "/templates"}
		var buf strings.Builder
		if err := t.ExecuteTemplate(&buf, name, vals); err != nil {
			return nil, fmt.Errorf("execution error in %s: %v", name, err)
		}
		out[name] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return out, nil
}

// Helm's install order (releaseutil.InstallOrder): what `helm template` sorts by.
var installOrder = []string{
	"PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
	"PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
	"ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
	"CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
	"ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service",
	"DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
	"HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
	"APIService",
}

var docSeparator = regexp.MustCompile(`(?:^|\s*\n)---\s*`)

type manifest struct {
	source, content, kind string
}

func splitManifests(rendered map[string]string) ([]manifest, error) {
	names := make([]string, 0, len(rendered))
	for name := range rendered {
		names = append(names, name)
	}
	sort.Strings(names)
	var out []manifest
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		for _, doc := range docSeparator.Split(rendered[name], -1) {
			doc = strings.TrimSpace(doc)
			if doc == "" {
				continue
			}
			var head struct {
				Kind string `json:"kind"`
			}
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				return nil, fmt.Errorf("YAML parse error on %s: %v", name, err)
			}
			out = append(out, manifest{source: name, content: doc, kind: head.Kind})
		}
	}
	rank := func(kind string) int {
		for i, k := range installOrder {
			if k == kind {
				return i
			}
		}
		return len(installOrder)
	}
	sort.SliceStable(out, func(i, j int) bool {
		ri, rj := rank(out[i].kind), rank(out[j].kind)
		if ri != rj {
			return ri < rj
		}
		if ri == len(installOrder) && out[i].kind != out[j].kind {
			return out[i].kind < out[j].kind
		}
		return false
	})
	return out, nil
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func run() error {
	var valueFiles, sets, apiVersions multiFlag
	fs := flag.NewFlagSet("helm_render", flag.ContinueOnError)
	name := fs.String("name", "release-name", "release name (.Release.Name)")
	namespace := fs.String("namespace", "default", "release namespace (.Release.Namespace)")
	kubeVersion := fs.String("kube-version", "1.31.0", "Kubernetes version for .Capabilities")
	notes := fs.String("notes", "", "write the rendered templates/NOTES.txt to this file")
	fs.Var(&valueFiles, "f", "values file (repeatable; later files win)")
	fs.Var(&valueFiles, "values", "values file (same as -f)")
	fs.Var(&sets, "set", "a.b.c=value (repeatable; applied after -f files)")
	fs.Var(&apiVersions, "api-versions", "extra API version for .Capabilities.APIVersions")
	var lookups multiFlag
	fs.Var(&lookups, "lookup", "YAML file of objects `lookup` finds, as in a cluster (repeatable); also sets .Release.IsUpgrade")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("usage: helm_render [flags] CHART_DIR")
	}
	c, err := loadChart(fs.Arg(0))
	if err != nil {
		return err
	}
	kv, err := semver.NewVersion(*kubeVersion)
	if err != nil {
		return fmt.Errorf("--kube-version %q: %v", *kubeVersion, err)
	}
	if c.meta.KubeVersion != "" {
		constraint, err := semver.NewConstraint(c.meta.KubeVersion)
		if err != nil {
			return fmt.Errorf("Chart.yaml kubeVersion %q: %v", c.meta.KubeVersion, err)
		}
		if !constraint.Check(kv) {
			return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes v%s",
				c.meta.KubeVersion, kv.String())
		}
	}
	user := map[string]interface{}{}
	for _, file := range valueFiles {
		data, err := ioutil.ReadFile(file)
		if err != nil {
			return err
		}
		m, err := readYAMLMap(data, file)
		if err != nil {
			return err
		}
		user = mergeMaps(user, m)
	}
	for _, s := range sets {
		if err := parseSet(user, s); err != nil {
			return err
		}
	}
	values := coalesce(user, c.defaults, "")
	caps := &Capabilities{
		KubeVersion: KubeVersion{
			Version: "v" + kv.String(),
			Major:   strconv.FormatUint(kv.Major(), 10),
			Minor:   strconv.FormatUint(kv.Minor(), 10),
		},
		APIVersions: append(VersionSet(append([]string{}, defaultAPIVersions...)), apiVersions...),
	}
	top := map[string]interface{}{
		"Values": values,
		"Release": map[string]interface{}{
			"Name": *name, "Namespace": *namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1,
		},
		"Chart":        &c.meta,
		"Capabilities": caps,
		"Files":        c.files,
	}
	var cluster []map[string]interface{}
	for _, file := range lookups {
		objects, err := readObjects(file)
		if err != nil {
			return err
		}
		cluster = append(append([]map[string]interface{}{}, cluster...), objects...)
	}
	if lookups != nil {
		release := top["Release"].(map[string]interface{})
		release["IsInstall"], release["IsUpgrade"], release["Revision"] = false, true, 2
	}
	rendered, err := renderAll(c, top, cluster)
	if err != nil {
		return err
	}
	manifests, err := splitManifests(rendered)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	for _, m := range manifests {
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", m.source, m.content)
	}
	if _, err := os.Stdout.Write(out.Bytes()); err != nil {
		return err
	}
	if *notes != "" {
		text := rendered[c.meta.Name+"/templates/NOTES.txt"]
		if err := ioutil.WriteFile(*notes, []byte(text), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}
