#!/usr/bin/perl

# A scriptable fake llama-server for the faults the real one cannot be made
# to show: slow or failing save/restore/erase, resets, restarts with empty
# slots.  It speaks enough of llama-server's API for the module:
#
#   GET  /health, /props, /slots
#   POST /slots/N?action=save|restore|erase   {"filename": "..."}
#   POST /completion, /v1/completions, /v1/chat/completions, /v1/embeddings
#        and anything else under POST: an inference with a fake cache
#   POST /apply-template: the messages' JSON, the last one on its own line
#   POST /tokenize: a character's code point for each token
#
# Its "KV cache" per slot is the request's prompt text; cache_n is the
# length of the common prefix (in characters) with the slot's text.  Save
# writes that text to the save folder, restore reads it back (400 and an
# empty slot when the file is missing), as the real server does.
#
# The fault script (--script, a JSON file read on every request) may hold,
# for "save", "restore", "erase", "slots" (GET /slots), "props",
# "models" (GET /v1/models) and "completion":
#   {"status": 500, "delay_ms": 300, "close": 1, "processing": 1}
# partial (save): write part of the file, then drop the connection, as a
# llama-server killed mid-save would; router (top level): GET /props
# answers as llama-server's router mode does, and GET /models lists
# router_list's models as loaded (router_models: its fault); short (save): a 200 whose file is
# shorter than its n_written, as a full disk gives; --model sets /props's
# model_path, --meta (JSON) what GET /v1/models says of the model;
# close: drop the connection without an answer; processing: GET /slots
# shows the slot busy; path: the completion fault applies to that path only;
# chunks, chunk_ms, chunk_bytes: the shape of a streamed reply; pre_ms (completion):
# time before the request takes the slot, which it does even if its client
# left meanwhile, as llama-server does; match: a regular expression the
# request's body must match for the fault to apply; until (completion): a file whose
# creation ends the delay (at most 120 s), for tests that must not race a
# clock; reply (completion): the JSON a non-streamed request gets, events
# (completion): the SSE events a streamed one gets, then [DONE];
# discard (restore): a 200 that leaves the slot empty, as models with
# recurrent or sliding-window layers do; apply (POST /apply-template):
# {"status": N}; speculative (top level): GET /slots shows the slots with
# a draft model; draft (top level): {"ms": N, "lost_ms": M}, the
# replies' timings say 16 tokens generated at N ms each, at M ms on a slot
# restored since its last erase; media (top level): a save of a slot whose text holds an
# "image_url" part answers 501 as a build that cannot serialise an image
# chunk does; restore_ms (restore): the time its reply reports (a slow
# disk); close_reused: N (save, restore, erase): drop the
# connection without an answer, the first N times the call comes on a
# connection that served a request before (a kept-alive one); times: N
# (any fault of the calls above): only the first N calls of that path and
# query get it; close_after (completion, with status): the error reply
# says keep-alive and the connection is closed unanswered when the next
# request comes on it, as a llama-server that closes after an error races
# nginx's next request; cut: N (completion, not streamed): the reply's
# headers and N bytes of its body, then the connection dropped;
# prefill_us (top level): a completion takes that many microseconds for
# each character of its prompt not in the slot, as a prefill does.
# --idle-close S: a request that comes on a connection idle for S seconds
# or more gets the connection closed, no answer, as cpp-httplib (which
# closes idle keep-alive connections after 5 s) does to a request that
# races its close.  Every request is appended to --calls as JSON.

use strict;
use warnings;

use Fcntl qw(:flock);
use Getopt::Long;
use IO::Socket::INET;
use JSON::PP;
use POSIX qw(:sys_wait_h);
use Time::HiRes qw(sleep time);

my %o = (np => 1, model => 'fake.gguf',
         meta => '{"n_vocab":32000,"size":1000000}');
GetOptions(\%o, 'port=i', 'np=i', 'slots=s', 'state=s', 'script=s',
           'calls=s', 'model=s', 'meta=s', 'idle-close=f') or die "usage\n";

my $json = JSON::PP->new->utf8->canonical->allow_nonref;

$SIG{CHLD} = sub { 1 while waitpid(-1, WNOHANG) > 0 };
$SIG{PIPE} = 'IGNORE';

# a new process starts with empty slots, as a restarted llama-server does
write_state({ start => time, task => 0,
              slots => [ map { { text => '', n => 0 } } 1 .. $o{np} ] });

my $server = IO::Socket::INET->new(LocalAddr => '127.0.0.1',
                                   LocalPort => $o{port}, Listen => 128,
                                   ReuseAddr => 1, Proto => 'tcp')
    or die "listen: $!";

while (1) {
    my $c = $server->accept or next;
    my $pid = fork();
    if (defined $pid && $pid == 0) {
        close $server;
        serve($c);
        exit 0;
    }
    close $c;
}

sub serve {
    my ($c) = @_;
    binmode $c;

    my $last;

    while (1) {
        my $req = read_request($c) or return;
        if (defined $last && $o{'idle-close'}
            && time - $last >= $o{'idle-close'})
        {
            log_call({ %$req, closed => 'idle' });
            close $c;
            return;
        }
        $req->{reused} = defined $last;
        my $keep = handle($c, $req);
        $last = time;
        if (($keep // 0) == 3) {
            # closed as the next request comes on it, unanswered
            my $next = read_request($c);
            log_call({ %$next, closed => 'after_error' }) if $next;
            close $c;
            return;
        }
        return unless $keep;
        return if ($req->{headers}{connection} // '') =~ /close/i;
    }
}

sub read_request {
    my ($c) = @_;
    my $head = '';
    while ($head !~ /\r\n\r\n/) {
        my $n = sysread($c, my $buf, 4096);
        return undef unless $n;
        $head .= $buf;
    }
    my ($h, $rest) = split /\r\n\r\n/, $head, 2;
    my ($line, @lines) = split /\r\n/, $h;
    my ($method, $target) = split / /, $line;
    my %headers;
    for (@lines) {
        my ($k, $v) = split /:\s*/, $_, 2;
        $headers{lc $k} = $v;
    }
    my $body = $rest // '';
    if (($headers{'transfer-encoding'} // '') =~ /chunked/i) {
        my $raw = $body;
        my $out = '';
        while (1) {
            while ($raw !~ /^([0-9a-fA-F]+)\r\n/) {
                sysread($c, my $b, 65536) or last;
                $raw .= $b;
            }
            $raw =~ s/^([0-9a-fA-F]+)\r\n// or last;
            my $len = hex $1;
            while (length($raw) < $len + 2) {
                sysread($c, my $b, 65536) or last;
                $raw .= $b;
            }
            $out .= substr($raw, 0, $len);
            $raw = substr($raw, $len + 2);
            last if $len == 0;
        }
        $body = $out;
    } else {
        my $len = $headers{'content-length'} // 0;
        while (length($body) < $len) {
            my $n = sysread($c, my $buf, $len - length($body));
            return undef unless $n;
            $body .= $buf;
        }
    }
    my ($path, $query) = split /\?/, $target, 2;
    return { method => $method, path => $path, query => $query // '',
             headers => \%headers, body => $body };
}

sub script {
    open my $fh, '<', $o{script} or return {};
    local $/;
    my $s = eval { $json->decode(<$fh>) } // {};
    close $fh;
    return $s;
}

sub log_call {
    my ($req) = @_;
    open my $fh, '>>', $o{calls} or return;
    flock $fh, LOCK_EX;
    my %h = %{ $req->{headers} };
    print $fh $json->encode({
        method => $req->{method}, path => $req->{path},
        query => $req->{query}, headers => \%h,
        body_len => length $req->{body},
        body => length($req->{body}) <= 65536 ? $req->{body} : undef,
        time => time,
        $req->{closed} ? (closed => $req->{closed}) : (),
    }), "\n";
    close $fh;
}

sub with_state {
    my ($code) = @_;
    open my $lock, '>>', "$o{state}.lock" or die;
    flock $lock, LOCK_EX;
    my $st = read_state();
    my @r = $code->($st);
    write_state($st);
    close $lock;
    return wantarray ? @r : $r[0];
}

sub read_state {
    open my $fh, '<', $o{state} or return {};
    local $/;
    my $s = $json->decode(<$fh>);
    close $fh;
    return $s;
}

sub write_state {
    my ($st) = @_;
    open my $fh, '>', "$o{state}.tmp" or die;
    print $fh $json->encode($st);
    close $fh;
    rename "$o{state}.tmp", $o{state};
}

sub reply {
    my ($c, $status, $body, %h) = @_;
    $body = $json->encode($body) if ref $body;
    my $hdr = join '', map { "$_: $h{$_}\r\n" } sort keys %h;
    print $c "HTTP/1.1 $status X\r\nContent-Type: application/json\r\n"
           . "Content-Length: " . length($body) . "\r\n$hdr"
           . "Connection: keep-alive\r\n\r\n$body";
    return 1;
}

sub error {
    my ($c, $status, $msg, $type) = @_;
    return reply($c, $status, { error => { code => $status, message => $msg,
                                           type => $type // 'server_error' } });
}

sub fault {
    my ($c, $f, $req) = @_;
    return 0 unless $f;
    return 0 if $f->{match} && $req
                && ($req->{body} // '') !~ /$f->{match}/;
    return 0 if $f->{times} && $req
                && with_state(sub { ($_[0]{times}{"$req->{path}?$req->{query}"}++
                                     // 0) >= $f->{times} });
    sleep $f->{delay_ms} / 1000 if $f->{delay_ms};
    if ($f->{close}) { close $c; return 2; }
    if ($f->{close_reused} && $req && $req->{reused}
        && with_state(sub { ($_[0]{close_reused}{$req->{path}}++ // 0)
                            < $f->{close_reused} }))
    {
        close $c;
        return 2;
    }
    if ($f->{status} && $f->{status} != 200) {
        error($c, $f->{status}, $f->{message} // 'scripted failure');
        return 1;
    }
    return 0;
}

sub handle {
    my ($c, $req) = @_;
    log_call($req);
    my $script = script();
    my ($m, $p) = ($req->{method}, $req->{path});

    if ($m eq 'GET' && $p =~ m{^/(v1/)?health$}) {
        return reply($c, 200, { status => 'ok' });
    }

    if ($m eq 'GET' && $p eq '/props') {
        my $f = fault($c, $script->{props}, $req);
        return $f == 1 if $f;
        if ($script->{router} && $req->{query} !~ /(^|&)model=/) {
            # llama-server without -m: its router (?model=: a child's)
            return reply($c, 200, { role => 'router', max_instances => 4,
                                    build_info => 'b1-fake' });
        }
        return reply($c, 200, { total_slots => $o{np},
                                model_path => $o{model},
                                default_generation_settings =>
                                    { n_ctx => 16384 } });
    }

    if ($m eq 'GET' && $p eq '/models' && $script->{router}) {
        # the router's list: router_list's models, loaded
        my $f = fault($c, $script->{router_models}, $req);
        return $f == 1 if $f;
        return reply($c, 200, { data => [
            map { { id => $_, status => { value => 'loaded' } } }
                @{ $script->{router_list} // [] } ] });
    }

    if ($m eq 'GET' && $p eq '/v1/models') {
        my $f = fault($c, $script->{models}, $req);
        return $f == 1 if $f;
        return reply($c, 200, { object => 'list', data => [
            { id => $o{model}, object => 'model',
              meta => $json->decode($o{meta}) } ] });
    }

    if ($m eq 'GET' && $p eq '/slots') {
        my $f = fault($c, $script->{slots}, $req);
        return $f == 1 if $f;
        my $st = read_state();
        my $i = 0;
        return reply($c, 200, [ map {
            # (a fake token is a character: its context holds any
            # prompt; "n_prompt_tokens" in the slots fault: a bogus count)
            { id => $i++, n_ctx => 1 << 24,
              speculative => $script->{speculative} ? JSON::PP::true
                                                    : JSON::PP::false,
              is_processing => ($script->{slots}{processing}
                                || $_->{busy}) ? JSON::PP::true
                                               : JSON::PP::false,
              $_->{ran} ? (n_prompt_tokens => $script->{slots}{n_prompt_tokens}
                                              // $_->{n},
                           id_task => $_->{task}) : () } }
            @{ $st->{slots} } ]);
    }

    if ($m eq 'POST' && $p =~ m{^/slots/(\d+)$}) {
        my $id = $1 % $o{np};
        my ($action) = $req->{query} =~ /action=(\w+)/;
        $action //= '';
        return error($c, 400, 'Invalid action', 'invalid_request_error')
            unless $action =~ /^(save|restore|erase)$/;
        my $f = fault($c, $script->{$action}, $req);
        return $f == 1 if $f;
        my $body = eval { $json->decode($req->{body} || '{}') };
        return error($c, 500, 'bad json') unless ref $body eq 'HASH';

        if ($action eq 'erase') {
            my $n = with_state(sub {
                my $s = $_[0]{slots}[$id];
                my $n = $s->{n};
                @$s{qw(text n restored)} = ('', 0, 0);
                return $n;
            });
            return reply($c, 200, { id_slot => $id, n_erased => $n });
        }

        my $name = $body->{filename};
        return error($c, 500, 'filename missing') unless defined $name;
        return error($c, 400, 'Invalid filename', 'invalid_request_error')
            if $name =~ m{[/\\]|\.\.} || $name eq '';
        my $file = "$o{slots}/$name";

        if ($action eq 'save') {
            my ($text, $n) = with_state(sub {
                my $s = $_[0]{slots}[$id];
                return ($s->{text}, $s->{n});
            });
            # a build that cannot serialise an image chunk (server-common's
            # server_tokens before v0.4.0's placeholders)
            return error($c, 501, 'Cannot serialize media chunk in server '
                                  . 'tokens', 'not_supported_error')
                if $script->{media} && $text =~ /"image_url"/;
            open my $fh, '>', $file
                or return error($c, 500, 'Unable to save slot');
            if ($script->{save}{partial}) {
                # killed in the middle of writing the file
                print $fh substr($json->encode({ text => $text }), 0, 5);
                close $fh;
                close $c;
                return 0;
            }
            # a full disk: llama-server answers 500, its file left short
            (print $fh $json->encode({ text => $text, n => $n }))
                && close $fh
                or return error($c, 500, 'Unable to save slot');
            my $written = -s $file;
            truncate $file, 3 if $script->{save}{short};
            return reply($c, 200, { id_slot => $id, filename => $name,
                                    n_saved => $n,
                                    n_written => $written,
                                    timings => { save_ms => 1.5 } });
        }

        # restore
        my $data;
        if (open my $fh, '<', $file) {
            local $/;
            $data = eval { $json->decode(<$fh>) };
            close $fh;
        }
        if (!$data) {
            with_state(sub { @{ $_[0]{slots}[$id] }{qw(text n)} = ('', 0) });
            return error($c, 400, 'Unable to restore slot: No available '
                         . 'space in KV cache or invalid slot save file',
                         'invalid_request_error');
        }
        # a model that discards a restored cache (recurrent or sliding-window
        # layers): the restore answers 200, the slot stays empty
        with_state(sub { @{ $_[0]{slots}[$id] }{qw(text n restored)}
                           = $script->{restore}{discard} ? ('', 0, 0)
                             : ($data->{text}, $data->{n}, 1) });
        return reply($c, 200, { id_slot => $id, filename => $name,
                                n_restored => $data->{n},
                                n_read => -s $file,
                                timings => { restore_ms =>
                                    $script->{restore}{restore_ms} // 0.5 } });
    }

    # the fake's chat template: the messages' JSON, the last one on a line
    # of its own, so that a render with a message appended shares a line
    # with the next turn's text (a prefix prime's cut, reprime.c)
    if ($m eq 'POST' && $req->{path} eq '/apply-template') {
        my $f = $script->{apply};
        return error($c, $f->{status}, 'scripted failure')
            if $f && $f->{status} && $f->{status} != 200;
        my $body = eval { $json->decode($req->{body}) } // {};
        my @m = @{ ref $body->{messages} eq 'ARRAY' ? $body->{messages} : [] };
        return error($c, 400, 'no messages', 'invalid_request_error') unless @m;
        my $last = pop @m;
        my $prompt = '[' . join(',', map { $json->encode($_) } @m)
                   . (@m ? ",\n" : '') . $json->encode($last) . ']';
        return reply($c, 200, { prompt => $prompt });
    }

    # a "token" is a character: its code point, as the slot's text is
    # characters (special tokens, add_special: nothing of the kind here)
    if ($m eq 'POST' && $req->{path} eq '/tokenize') {
        my $body = eval { $json->decode($req->{body}) } // {};
        return error($c, 400, 'no content', 'invalid_request_error')
            unless defined $body->{content} && !ref $body->{content};
        # written by hand: a conversation is megabytes of tokens, more
        # than JSON::PP encodes in a test's time
        return reply($c, 200, '{"tokens":['
                     . join(',', unpack('U*', $body->{content})) . ']}');
    }

    if ($m eq 'POST') {
        return completion($c, $req, $script->{completion});
    }

    return error($c, 404, 'File Not Found', 'not_found_error');
}

# the length of the common prefix of two texts, by halving: a character
# at a time is quadratic on wide-character strings (substr walks them)
sub common {
    my ($a, $b) = @_;
    my ($lo, $hi) = (0, length $a < length $b ? length $a : length $b);
    while ($lo < $hi) {
        my $m = int(($lo + $hi + 1) / 2);
        if (substr($a, 0, $m) eq substr($b, 0, $m)) { $lo = $m } else { $hi = $m - 1 }
    }
    return $lo;
}

sub completion {
    my ($c, $req, $f) = @_;

    # a prompt of tokens is read by a pattern before the rest is decoded:
    # JSON::PP takes seconds over the megabytes of a long conversation's
    my $tokens;
    my $raw = $req->{body};
    if ($raw =~ s/"prompt"\s*:\s*\[([\d,\s]*)\]/"prompt":0/) {
        $tokens = pack 'U*', map { $_ + 0 } split /\s*,\s*/, $1 =~ s/^\s+//r;
        utf8::downgrade($tokens, 1);
    }
    my $body = eval { $json->decode($raw) } // {};

    # llama-server tokenizes before its task takes a slot: "pre_ms" delays
    # that, whatever became of the client meanwhile
    sleep $f->{pre_ms} / 1000
        if $f && $f->{pre_ms} && (!$f->{path} || $f->{path} eq $req->{path});

    my $id = defined $body->{id_slot} && $body->{id_slot} >= 0
             ? $body->{id_slot} % $o{np} : 0;
    # a prompt given as text, or as tokens (/tokenize's code points), is
    # the slot's text as it is (a prefix prime)
    my $text = ref $body ne 'HASH' ? $req->{body}
             : defined $tokens && !defined $body->{messages} ? $tokens
             : defined $body->{prompt} && !ref $body->{prompt}
               && !defined $body->{messages} ? $body->{prompt}
             : $json->encode($body->{messages} // $body->{prompt}
                             // $body->{input} // $body->{system} // '');

    # the slot is taken while the request runs
    my $cache_n = with_state(sub {
        my $s = $_[0]{slots}[$id];
        my $old = $s->{text};
        my $n = common($old, $text);
        $s->{busy} = 1;
        $s->{task} = $_[0]{task}++;
        return $n;
    });

    my $done = sub {
        with_state(sub {
            my $s = $_[0]{slots}[$id];
            @$s{qw(text n busy ran)} = ($text, length $text, 0, 1);
        });
    };

    $f = undef if $f && $f->{path} && $f->{path} ne $req->{path};
    $f = undef if $f && $f->{match} && $req->{body} !~ /$f->{match}/;

    if ($f) {
        sleep $f->{delay_ms} / 1000 if $f->{delay_ms};
        if ($f->{until}) {
            my $end = time + 120;
            sleep 0.02 until -e $f->{until} || time > $end;
        }
        if ($f->{close}) { $done->(); close $c; return 0; }
        if ($f->{status} && $f->{status} != 200) {
            $done->();
            error($c, $f->{status}, 'scripted failure');
            # it said keep-alive, and closes as the next request comes:
            # llama-server after an error
            return $f->{close_after} ? 3 : 1;
        }
    }

    # the prefill of what the slot did not hold: "prefill_us" (top level)
    # microseconds a character, spent (else none, reported at 0.5 ms)
    my $us = script()->{prefill_us};
    sleep((length($text) - $cache_n) * $us / 1e6) if $us;

    my %timings = (cache_n => $cache_n, prompt_n => length($text) - $cache_n,
                   prompt_ms => (length($text) - $cache_n)
                                * ($us ? $us / 1000 : 0.5));
    # a draft model: 16 tokens generated, slower on a slot restored since
    # its last erase (the draft's own context is not in a slot file)
    if (my $d = script()->{draft}) {
        my $lost = with_state(sub { $_[0]{slots}[$id]{restored} });
        $timings{predicted_n} = 16;
        $timings{predicted_ms} = 16 * ($lost ? $d->{lost_ms} : $d->{ms});
    }
    my $usage = { prompt_tokens => length $text, completion_tokens => 1,
                  prompt_tokens_details => { cached_tokens => $cache_n } };
    my %echo = (body_len => length $req->{body},
                slot => $id,
                session => $req->{headers}{'x-session-id'});

    if ($req->{path} =~ m{/embeddings$}) {
        $done->();
        return reply($c, 200, { data => [ { index => 0,
                                            embedding => [ 0.25, -0.5 ] } ],
                                usage => { prompt_tokens => length $text } });
    }

    # scripted replies (completion.reply, completion.events): a tool call,
    # reasoning, a finish reason, as a model would give them
    if ($f && $f->{events} && $body->{stream}) {
        print $c "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               . "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        for my $e (@{ $f->{events} }, '[DONE]') {
            my $ev = 'data: ' . (ref $e ? $json->encode($e) : $e) . "\n\n";
            printf $c "%x\r\n%s\r\n", length $ev, $ev or last;
        }
        print $c "0\r\n\r\n";
        $done->();
        return 0;
    }

    # the reply's headers and "cut" bytes of its body, then the
    # connection dropped: a backend that began to answer and died
    if ($f && $f->{cut} && !$body->{stream}) {
        my $out = $json->encode({ content => 'tok' x 64,
                                  timings => \%timings, usage => $usage });
        print $c "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
               . "Content-Length: " . length($out) . "\r\n\r\n"
               . substr($out, 0, $f->{cut});
        $done->();
        close $c;
        return 0;
    }

    if ($f && $f->{reply} && !$body->{stream}) {
        $done->();
        return reply($c, 200, { %{ $f->{reply} }, timings => \%timings,
                                usage => $usage });
    }

    if ($body->{stream}) {
        print $c "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               . "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        my $n = $f->{chunks} // 3;
        my $pad = 'x' x ($f->{chunk_bytes} // 0);
        for my $i (1 .. $n) {
            my $ev = "data: " . $json->encode({
                content => "tok$i$pad", choices => [ { delta =>
                    { content => "tok$i$pad" } } ],
                ($i == $n ? (timings => \%timings, usage => $usage) : ()),
                %echo }) . "\n\n";
            printf $c "%x\r\n%s\r\n", length $ev, $ev or last;
            sleep(($f->{chunk_ms} // 10) / 1000);
        }
        my $end = "data: [DONE]\n\n";
        printf $c "%x\r\n%s\r\n0\r\n\r\n", length $end, $end;
        $done->();
        return 0;
    }

    $done->();

    return reply($c, 200, {
        content => 'ok', timings => \%timings, usage => $usage,
        choices => [ { message => { role => 'assistant',
                                    content => 'ok' } } ],
        %echo });
}
