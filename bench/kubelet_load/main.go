// kubelet_load: the kubelet stand-in of bench/allocate_roundtrip.py.
//
// Kubelet is Go and talks to device plugins with grpc-go, so the bench's timed
// Allocate calls come from grpc-go too, in a process of their own: a Python client in
// the bench process would spend its own CPU next to the services being measured.
//
// It dials one plugin socket the way kubelet's device manager does (one connection,
// insecure, authority "localhost", a unix dialer) and then reads batches of waves from
// stdin, one JSON line each:
//
//	{"waves": [["<base64 serialized v1beta1.AllocateRequest>", ...], ...]}
//
// It runs the waves one after the other; the calls of a wave start at once (one
// goroutine each) and the next wave starts when all have answered. It times each call
// itself (just before Invoke to its return) and answers one JSON line per batch, the
// calls of all its waves in order:
//
//	{"calls": [{"latency_ms": 1.2, "ok": true, "response": "<base64 AllocateResponse>"},
//	           {"latency_ms": 30000, "ok": false, "code": "DeadlineExceeded", "message": "..."}]}
//
// One message per batch rather than per wave keeps this process and the bench's
// quiet between calls.
//
// The messages travel as raw bytes (a pass-through codec), so no generated protobuf
// code is needed: the bench encodes and decodes them with kubelet's own protos.
// Before the first wave it prints {"ready": true} once connected. It exits 0 on stdin
// EOF.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// rawCodec passes serialized messages through untouched.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: want *[]byte, got %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: want *[]byte, got %T", v)
	}
	*b = append((*b)[:0], data...)
	return nil
}

// Name is the content-subtype: "application/grpc+proto", what a protobuf client sends.
func (rawCodec) Name() string { return "proto" }

type batch struct {
	Waves [][][]byte `json:"waves"` // base64 in JSON
}

type result struct {
	LatencyMs float64 `json:"latency_ms"`
	OK        bool    `json:"ok"`
	Code      string  `json:"code,omitempty"`
	Message   string  `json:"message,omitempty"`
	Response  []byte  `json:"response,omitempty"` // base64 in JSON
}

type answer struct {
	Calls []result `json:"calls"`
}

func dial(socket string, timeout time.Duration) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// As kubelet's device manager dials a plugin (pkg/kubelet/cm/devicemanager).
	return grpc.DialContext(ctx, socket,
		grpc.WithAuthority("localhost"),
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
}

func call(conn *grpc.ClientConn, method string, request []byte, timeout time.Duration) result {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var response []byte
	started := time.Now()
	err := conn.Invoke(ctx, method, &request, &response, grpc.ForceCodec(rawCodec{}))
	r := result{LatencyMs: float64(time.Since(started).Nanoseconds()) / 1e6}
	if err != nil {
		s := status.Convert(err)
		r.Code, r.Message = s.Code().String(), s.Message()
		return r
	}
	r.OK, r.Response = true, response
	return r
}

func main() {
	socket := flag.String("socket", "", "the plugin's unix socket")
	method := flag.String("method", "/v1beta1.DevicePlugin/Allocate", "full gRPC method name")
	timeout := flag.Duration("timeout", 30*time.Second, "deadline of each call")
	dialTimeout := flag.Duration("dial-timeout", 10*time.Second, "deadline of the connection")
	flag.Parse()
	if *socket == "" {
		fmt.Fprintln(os.Stderr, "kubelet_load: -socket is required")
		os.Exit(2)
	}
	conn, err := dial(*socket, *dialTimeout)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet_load: dial %s: %v\n", *socket, err)
		os.Exit(1)
	}
	defer conn.Close()

	out := bufio.NewWriter(os.Stdout)
	encoder := json.NewEncoder(out)
	emit := func(v interface{}) {
		if err := encoder.Encode(v); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet_load: write: %v\n", err)
			os.Exit(1)
		}
		if err := out.Flush(); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet_load: write: %v\n", err)
			os.Exit(1)
		}
	}
	emit(map[string]bool{"ready": true})

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	for in.Scan() {
		var b batch
		if err := json.Unmarshal(in.Bytes(), &b); err != nil {
			fmt.Fprintf(os.Stderr, "kubelet_load: bad batch: %v\n", err)
			os.Exit(2)
		}
		var results []result
		for _, wave := range b.Waves {
			answers := make([]result, len(wave))
			var wg sync.WaitGroup
			wg.Add(len(wave))
			for i, request := range wave {
				go func(i int, request []byte) {
					defer wg.Done()
					answers[i] = call(conn, *method, request, *timeout)
				}(i, request)
			}
			wg.Wait()
			results = append(results, answers...)
		}
		emit(answer{Calls: results})
	}
	if err := in.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet_load: read: %v\n", err)
		os.Exit(1)
	}
}
