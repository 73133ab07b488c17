package LlamaTest;

# The test rig: a temp dir per test file, nginx (master + workers) with the
# module, a real llama-server or the scriptable fake one, on free loopback
# ports; everything is stopped at the end, even when a test dies, and the
# temp dir is kept (and named) when a test failed.
#
# Environment:
#   LLAMA_SERVER      llama-server binary (default: the rig's cached build)
#   LLAMA_MODEL       model file (default: the rig's cached model)
#   NGINX_BINARY      nginx (default /usr/sbin/nginx)
#   NGINX_MODULE      the module (default objs/ngx_http_llama_session_module.so)
#   TEST_NGINX_VALGRIND=1   run nginx under valgrind (t/valgrind.supp)
#   TEST_KEEP=1       keep the temp dir even when all passed

use strict;
use warnings;

use Cwd qw(abs_path);
use File::Basename qw(dirname);
use File::Path qw(make_path remove_tree);
use File::Temp qw(tempdir);
use HTTP::Tiny;
use IO::Socket::INET;
use Encode ();
use JSON::PP;
use POSIX qw(:sys_wait_h);
use Test::More;
use Time::HiRes qw(sleep time);

our $ROOT = abs_path(dirname(__FILE__) . '/../..');
our $JSON = JSON::PP->new->utf8->canonical->allow_nonref;

my @ALL;

sub new {
    my ($class, %opts) = @_;

    make_path('/tmp/llama-session-tests');
    my $dir = tempdir('XXXXXX', DIR => '/tmp/llama-session-tests');
    chmod 0755, $dir;

    my $self = bless {
        dir      => $dir,
        workers  => $opts{workers} // 2,
        pids     => {},
        http     => HTTP::Tiny->new(timeout => $opts{timeout} // 120,
                                    keep_alive => 0),
    }, $class;

    push @ALL, $self;
    return $self;
}

sub dir { $_[0]{dir} }

# nginx's workers run as this user, as in production (not root)
our $USER = $ENV{TEST_NGINX_USER} // 'www-data';

# the store folder as the docs set it up: the backend writes there, the
# workers' group may rename and delete (setgid, group of the workers)
sub slots_dir {
    my ($dir, $owner) = @_;
    make_path($dir);
    my $gid = (getpwnam($USER))[3] // 0;
    chown $owner // 0, $gid, $dir;
    chmod 02775, $dir;
    return $dir;
}

# the real llama-server runs as a user of its own, as in production
our $LLAMA_USER = $ENV{TEST_LLAMA_USER} // 'nobody';

sub port {
    my $s = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => 0,
                                  Proto => 'tcp', Listen => 1, ReuseAddr => 1)
        or die "no free port: $!";
    my $port = $s->sockport;
    close $s;
    return $port;
}

sub rig_path {
    my ($script) = @_;
    my $out = `$ROOT/rig/$script 2>/dev/null`;
    chomp $out;
    die "rig/$script failed: run 'make rig'\n" unless $out && -e $out;
    return $out;
}

sub llama_binary { $ENV{LLAMA_SERVER} // rig_path('build-llama-server.sh') }

# a real chat template of llama.cpp's tree (models/templates/NAME.jinja), of
# the llama-server the tests run
sub chat_template {
    my ($name) = @_;
    my $file = dirname(dirname(rig_path('build-llama-server.sh')))
             . "/src/models/templates/$name.jinja";
    die "no template $file\n" unless -e $file;
    return $file;
}
sub llama_model  { $ENV{LLAMA_MODEL} // rig_path('make-model.sh') }

sub spawn {
    my ($self, $name, $log, @cmd) = @_;
    my $as = ref $cmd[-1] ? pop @cmd : {};

    my $pid = fork();
    die "fork: $!" unless defined $pid;

    if ($pid == 0) {
        setpgrp(0, 0);
        open STDIN, '<', '/dev/null';
        open STDOUT, '>>', $log or die;
        open STDERR, '>&', \*STDOUT or die;
        if (defined $as->{uid} && $> == 0) {
            $( = $) = "$as->{gid} $as->{gid}";
            $< = $> = $as->{uid};
            die "cannot become uid $as->{uid}\n" unless $> == $as->{uid};
        }
        exec @cmd or die "exec $cmd[0]: $!";
    }

    $self->{pids}{$name} = $pid;
    return $pid;
}

sub wait_port {
    my ($self, $port, $timeout, $name) = @_;
    my $end = time + ($timeout // 30);

    while (time < $end) {
        my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                                      PeerPort => $port, Proto => 'tcp');
        if ($s) { close $s; return 1; }
        if ($name && $self->{pids}{$name}
            && waitpid($self->{pids}{$name}, WNOHANG) > 0)
        {
            delete $self->{pids}{$name};
            die "$name exited at start, see $self->{dir}\n";
        }
        sleep 0.05;
    }

    die "nothing listens on port $port after ${\($timeout // 30)}s\n";
}

# a real llama-server: returns its port.  Options: np, ctx, args (array),
# slots (save folder, default DIR/slots), name, model (a path), cache_ram
# (MiB, default 0) and sps (-sps, default 0): llama-server's RAM cache
sub llama {
    my ($self, %o) = @_;

    my $name = $o{name} // 'llama';
    my $port = $o{port} // port();
    my ($uid, $gid) = (getpwnam($LLAMA_USER))[2, 3];
    my $slots = slots_dir($o{slots} // "$self->{dir}/slots", $uid);

    my @cmd = (llama_binary(), '-m', $o{model} // llama_model(),
               '--host', '127.0.0.1', '--port', $port,
               '-np', $o{np} // 1, '-c', $o{ctx} // 16384,
               '--slot-save-path', $slots,
               '--no-kv-unified', '--no-cache-idle-slots',
               '-sps', $o{sps} // 0,
               '--cache-ram', $o{cache_ram} // 0, '-t', 2, '--no-webui',
               @{ $o{args} // [] });

    $self->spawn($name, "$self->{dir}/$name.log", @cmd,
                 { uid => $uid, gid => $gid });
    $self->wait_port($port, 60, $name);

    # the port opens before the model is loaded: wait for /health 200
    my $end = time + 60;
    while (time < $end) {
        my $r = $self->{http}->get("http://127.0.0.1:$port/health");
        last if $r->{status} == 200;
        sleep 0.1;
    }

    $self->{llama_port}{$name} = $port;
    $self->{slots} = $slots;
    return $port;
}

# a model of the rig with another number of layers (router mode): its path
sub llama_model_layers {
    my ($layers) = @_;
    return llama_model() if $layers == 8;
    return rig_path("make-model.sh $layers");
}

# llama-server in router mode: models => { name => layers, ... } (the rig's
# model with that many layers, so each model's files have their own size),
# max => --models-max; every model's child gets -np, -c and the slot flags
sub router {
    my ($self, %o) = @_;

    my $name = $o{name} // 'llama';
    my $port = $o{port} // port();
    my ($uid, $gid) = (getpwnam($LLAMA_USER))[2, 3];
    my $slots = slots_dir($o{slots} // "$self->{dir}/slots", $uid);
    my $models = "$self->{dir}/$name.models";

    mkdir $models;
    for my $m (sort keys %{ $o{models} }) {
        symlink llama_model_layers($o{models}{$m}), "$models/$m.gguf"
            or die "symlink: $!";
    }

    my @cmd = (llama_binary(), '--models-dir', $models,
               '--models-max', $o{max} // 1,
               '--host', '127.0.0.1', '--port', $port,
               '-np', $o{np} // 1, '-c', $o{ctx} // 8192,
               '--slot-save-path', $slots,
               '--no-kv-unified', '--no-cache-idle-slots', '-sps', 0,
               '--cache-ram', 0, '-t', 2, '--no-webui',
               @{ $o{args} // [] });

    # the router looks into the Hugging Face cache of its home
    local $ENV{HOME} = $models;
    local $ENV{XDG_CACHE_HOME} = "$models/.cache";

    $self->spawn($name, "$self->{dir}/$name.log", @cmd,
                 { uid => $uid, gid => $gid });
    $self->wait_port($port, 60, $name);

    $self->{llama_port}{$name} = $port;
    $self->{slots} = $slots;
    return $port;
}

# the router's models and their status: { name => 'loaded', ... }
sub router_models {
    my ($self, $name) = @_;
    my $port = $self->{llama_port}{$name // 'llama'};
    my $r = $self->{http}->get("http://127.0.0.1:$port/models");
    return {} unless $r->{success};
    my $j = $JSON->decode($r->{content});
    return { map { $_->{id} => $_->{status}{value} } @{ $j->{data} } };
}

# the scriptable fake llama-server (t/fake-llama-server.pl): returns its port
sub fake {
    my ($self, %o) = @_;

    my $name = $o{name} // 'fake';
    my $port = $o{port} // port();
    my $slots = slots_dir($o{slots} // "$self->{dir}/slots");

    $self->{fake_script}{$name} = "$self->{dir}/$name.script.json";
    $self->fake_script($o{script} // {}, $name);

    $self->spawn($name, "$self->{dir}/$name.log", $^X,
                 "$ROOT/t/fake-llama-server.pl", '--port', $port,
                 '--np', $o{np} // 1, '--slots', $slots,
                 '--state', "$self->{dir}/$name.state",
                 '--script', $self->{fake_script}{$name},
                 '--calls', "$self->{dir}/$name.calls",
                 $o{model} ? ('--model', $o{model}) : (),
                 $o{idle_close} ? ('--idle-close', $o{idle_close}) : (),
                 $o{meta} ? ('--meta', $JSON->encode($o{meta})) : ());
    $self->wait_port($port, 10, $name);

    $self->{llama_port}{$name} = $port;
    $self->{slots} = $slots;
    return $port;
}

# rewrites the fake backend's fault script; it reads it on every request
sub fake_script {
    my ($self, $script, $name) = @_;
    $name //= 'fake';
    my $f = $self->{fake_script}{$name};
    open my $fh, '>', "$f.tmp" or die;
    print $fh $JSON->encode($script);
    close $fh;
    rename "$f.tmp", $f or die;
}

# the calls the fake backend got, in order: [{method, path, query, headers,
# body}, ...]
# a call the module makes for a prefix prime (reprime.c), not a client's:
# a render, its tokens, or the completion that makes the slot hold the
# prefix
sub prefix_call {
    my ($c) = @_;
    return $c->{path} eq '/apply-template' || $c->{path} eq '/tokenize'
        || ($c->{path} eq '/completion'
            && ($c->{body} // '') =~ /^\{"n_predict":1,"cache_prompt":true,"id_slot":\d+,/);
}

sub fake_calls {
    my ($self, $name) = @_;
    my $f = "$self->{dir}/" . ($name // 'fake') . '.calls';
    return [] unless -e $f;
    open my $fh, '<', $f or die;
    my @calls = map { $JSON->decode($_) } grep { /\S/ } <$fh>;
    close $fh;
    return \@calls;
}

# the fingerprint in file names for the fake backend: /props (n_ctx 16384,
# slots, no ftype nor build, model path) then /v1/models' meta, in the
# module's order
sub fake_fp {
    my ($model, %o) = @_;
    require Digest::SHA;
    my $meta = $o{meta} // { n_vocab => 32000, size => 1000000 };
    my $text = join "\0", 16384, $o{np} // 1, '', '', $model // 'fake.gguf';
    for my $k (qw(n_vocab n_ctx_train n_embd n_params size ftype vocab_type)) {
        $text .= "\0$k=$meta->{$k}" if defined $meta->{$k};
    }
    return substr(Digest::SHA::sha256_hex($text), 0, 8);
}

# a turn of a conversation: the same first message (part of the session's
# key, with the system prompt), then the text
sub conversation {
    my ($text) = @_;
    return { messages => [ { role => 'user',
                             content => 'Hello, this is our conversation.' },
                           { role => 'assistant', content => 'Go on.' },
                           { role => 'user', content => $text } ] };
}

# the session key the module derives (body.c): the id through a strict
# charset, then SHA-256 of namespace, model, id and the request's prefix:
# its system prompt (with tools) and the first 256 bytes of the first
# message after it.  %o: ns, model, body (the request, as sent)
sub session_key {
    my ($id, %o) = @_;
    require Digest::SHA;
    my $body = $o{body} // {};
    my ($sys, $n, $head) = ('', 0);
    my $text = sub {
        my ($c, $billing) = @_;
        my @t = !ref $c ? ($c)
              : ref $c eq 'ARRAY' ? map { !ref $_ ? $_ : ref $_ eq 'HASH'
                                          && defined $_->{text}
                                          && !ref $_->{text}
                                          ? $_->{text} : () } @$c
              : ();
        @t = grep { defined && length } @t;
        if ($billing) {
            s/^(x-anthropic-billing-header:.*?cch=)[^;]{5};/${1}fffff;/s
                for @t;
        }
        return @t;
    };
    my @s = defined $body->{system} ? $text->($body->{system}, 1) : ();
    my $i = 0;
    my $msgs = ref $body->{messages} eq 'ARRAY' ? $body->{messages} : [];
    for (; $i < @$msgs; $i++) {
        my $m = $msgs->[$i];
        last unless ref $m eq 'HASH' && defined $m->{role}
                    && ($m->{role} eq 'system' || $m->{role} eq 'developer');
        push @s, $text->($m->{content}) if defined $m->{content};
    }
    $sys = join "\n", map { Encode::encode('UTF-8', $_) } @s;
    my $sys_len = length $sys;
    for my $k (qw(tools tool_choice chat_template_kwargs)) {
        my $v = $body->{$k};
        next unless defined $v;
        next if $k eq 'tools' && ref $v eq 'ARRAY' && !@$v;
        my $raw = $JSON->encode($v);
        $sys .= "\0$raw";
        $sys_len += length $raw;
    }
    my $in = ($o{ns} // '') . "\0" . ($o{model} // '') . "\0$id";
    $in .= "\0s" . substr(Digest::SHA::sha256($sys), 0, 8) if $sys_len;
    if ($i < @$msgs) {
        my $m = $msgs->[$i];
        my $h = $JSON->encode($m->{role}) . "\0";
        my $t = join "\n", map { Encode::encode('UTF-8', $_) }
                               $text->($m->{content});
        $h .= substr($t, 0, 256);
        $in .= "\0h" . substr(Digest::SHA::sha256($h), 0, 8);
    }
    (my $safe = substr($id, 0, 32)) =~ s/[^A-Za-z0-9_-]/_/g;
    return "$safe-" . substr(Digest::SHA::sha256_hex($in), 0, 24);
}

sub stop_proc {
    my ($self, $name, $sig) = @_;
    my $pid = delete $self->{pids}{$name} or return;

    kill $sig // 'TERM', $pid;

    # what the process left in its group goes with it: the fake backend's
    # per-connection children would otherwise go on answering on
    # connections nginx keeps alive, as a restarted llama-server does not
    my $end = time + 10;
    while (time < $end) {
        if (waitpid($pid, WNOHANG) != 0) {
            kill 'KILL', -$pid;
            return;
        }
        sleep 0.05;
    }

    kill 'KILL', -$pid;
    kill 'KILL', $pid;
    waitpid($pid, 0);
}

sub stop_llama { $_[0]->stop_proc($_[1] // 'llama', 'TERM') }

sub module_path {
    return $ENV{NGINX_MODULE}
        // "$ROOT/objs/ngx_http_llama_session_module.so";
}

# writes DIR/nginx.conf from the template and starts nginx.  In the template:
# %%PORT%% nginx's port, %%LLAMA%% the backend's port (or %%LLAMA:name%%),
# %%DIR%%, %%SLOTS%%; the events and http {} wrappers are added.  Options:
# workers, log_level, main (directives of the main context), write_only.
sub nginx {
    my ($self, $http, %o) = @_;

    $self->{nginx_port} //= port();
    my $conf = $self->expand($http);
    my $dir = $self->{dir};
    my $workers = $o{workers} // $self->{workers};
    my $module = module_path();

    make_path("$dir/tmp");

    open my $fh, '>', "$dir/nginx.conf" or die;
    print $fh <<"EOF";
load_module $module;
worker_processes $workers;
daemon off;
master_process on;
pid $dir/nginx.pid;
error_log $dir/error.log ${\($o{log_level} // 'info')};
user $USER;
${\($o{main} // '')}
events { worker_connections 1024; }

http {
    access_log $dir/access.log;
    client_body_temp_path $dir/tmp/body;
    proxy_temp_path $dir/tmp/proxy;
    fastcgi_temp_path $dir/tmp/fastcgi;
    uwsgi_temp_path $dir/tmp/uwsgi;
    scgi_temp_path $dir/tmp/scgi;

$conf
}
EOF
    close $fh;

    return $self if $o{write_only};

    return $self->start_nginx;
}

# Many llama-servers behind one nginx (docs/scaling.md): a zone per
# llama-server, each in a server of its own (an owner, on a port kept for
# the test's life: owner_port(name)), and a front server on %%PORT%% that
# routes each session by an upstream over the owners.  Text for nginx().
# Options:
#   names     the owners, each a llama-server started with llama(name =>)
#   store     sub { name } giving each zone's store folder
#   zone      more parameters of each llama_session_zone (shared=on ...),
#             or sub { name } giving them
#   extra     sub { name } giving more locations of an owner's server
#   slots     more directives of the slots locations (proxy_read_timeout)
#   balance   the upstream's balancing, default
#             'hash $llama_session_key consistent'
#   fail      fail_timeout of each server, default 30s
#   down      { name => 1 }: servers marked down
#   front     0: no front; the first owner listens on %%PORT%% (a test
#             then plays the front, sending each turn to an owner)
# Each owner's replies say X-Backend (its name) and X-S-Action.
sub owners {
    my ($self, %o) = @_;
    my $balance = $o{balance} // 'hash $llama_session_key consistent';
    my $fail = $o{fail} // '30s';
    my $zone = ref $o{zone} ? $o{zone} : do { my $z = $o{zone} // '';
                                              sub { $z } };
    my $extra = $o{extra} // sub { '' };
    my $slots = $o{slots} // '';
    my $front = $o{front} // 1;
    my ($conf, $servers) = ('', '');
    $self->{owner_port}{ $o{names}[0] } = $self->{nginx_port} //= port()
        unless $front;
    for my $b (@{ $o{names} }) {
        my $port = $self->{owner_port}{$b} //= port();
        my $store = $o{store}->($b);
        my $z = $zone->($b);
        my $more = $extra->($b);
        $conf .= <<"EOF";
    llama_session_zone zone=$b:1m store=$store$z;

    server {
        listen 127.0.0.1:$port;

        location / {
            llama_session $b;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%;
            proxy_read_timeout 300s;
            add_header X-S-Action \$llama_session_action always;
            add_header X-Backend $b always;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%/;
            $slots
        }
        $more
    }

EOF
        $servers .= "        server 127.0.0.1:$port max_fails=1 "
                  . "fail_timeout=$fail" . ($o{down}{$b} ? ' down' : '')
                  . ";\n";
    }
    return $conf unless $front;
    return $conf . <<"EOF";
    upstream owners {
        $balance;
$servers    }

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session identity;
            proxy_pass http://owners;
            proxy_read_timeout 300s;
            # a backend's llama-server down: the owner answers 502 before
            # anything ran, so the request may go to the next one
            proxy_next_upstream error timeout http_502 non_idempotent;
        }
    }
EOF
}

sub owner_port { $_[0]{owner_port}{ $_[1] } }

# A conversation's next turn, kept in the test object by its id: a system
# prompt of 40 rules (or "system"), a first message of "notes" notes of
# its own (default 40), the reply and "More for ID?" appended after each
# turn.  Sent with X-Session-Id, to "owner"'s port (owner_port()) or
# nginx's.  Returns the status, and of a 200: prompt, cached (tokens),
# action and backend (the owners' headers).
sub chat_turn {
    my ($self, $sid, %o) = @_;
    my $conv = $self->{conv}{$sid} //= first_conv($sid, %o);
    my $r = $self->post('/v1/chat/completions',
                        { messages => $conv, max_tokens => $o{max_tokens} // 2,
                          temperature => 0 },
                        headers => { 'X-Session-Id' => $sid },
                        $o{owner} ? (port => $self->owner_port($o{owner}))
                                  : ());
    return { status => $r->{status}, content => $r->{content} }
        unless $r->{status} == 200;
    push @$conv,
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "More for $sid?" };
    return { status => 200,
             prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
             action => $r->{headers}{'x-s-action'},
             slot => $r->{headers}{'x-s-slot'},
             backend => $r->{headers}{'x-backend'},
             headers => $r->{headers} };
}

# chat_turn()'s conversation before its first turn (system, notes)
sub first_conv {
    my ($sid, %o) = @_;
    return [
        { role => 'system', content => $o{system}
                            // join ' ', map { "Rule $_ of the house." }
                                             1 .. 40 },
        { role => 'user', content => join ' ', map { "Session $sid note $_." }
                                                   1 .. ($o{notes} // 40) } ];
}

# the key of chat_turn()'s conversation before its first turn
sub first_key {
    my ($sid) = @_;
    return session_key($sid, body => { messages => first_conv($sid) });
}

# nginx's "hash ... consistent" ring over servers 127.0.0.1:PORT (name =>
# port): crc32(HOST \0 PORT PREV), 160 points each, sorted
sub chash_ring {
    my (%port) = @_;
    require Compress::Zlib;
    my @ring;
    for my $b (sort keys %port) {
        my $base = "127.0.0.1\0$port{$b}";
        my $prev = 0;
        for (1 .. 160) {
            my $h = Compress::Zlib::crc32(pack('V', $prev),
                                          Compress::Zlib::crc32($base));
            push @ring, [ $h, $b ];
            $prev = $h;
        }
    }
    return [ sort { $a->[0] <=> $b->[0] } @ring ];
}

# a key's home on that ring: the first point at or after crc32(key)
sub chash_home {
    my ($ring, $key) = @_;
    my $h = Compress::Zlib::crc32($key);
    for my $p (@$ring) {
        return $p->[1] if $p->[0] >= $h;
    }
    return $ring->[0][1];
}

# the key of a conversation chat_turn() keeps
sub chat_key {
    my ($self, $sid) = @_;
    return session_key($sid, body => {
        messages => [ @{ $self->{conv}{$sid} }[0, 1] ] });
}

# the usual site of a test, as text for nginx() (or nginx_test()):
#
#   llama_session_zone ...;                          zone
#   upstream llama { server 127.0.0.1:%%LLAMA%%; }   with upstream => only
#   ...                                              http
#   server {
#       listen 127.0.0.1:%%PORT%%;                   + listen
#       ...                                          server
#       location / {
#           llama_session NAME;                      the first zone's name
#           proxy_pass http://BACKEND;
#           ...                                      location
#       }
#       location /_llama_slots/ {
#           internal;
#           proxy_pass http://BACKEND/;
#           ...                                      slots
#       }
#       ...                                          extra
#   }
#
# Pieces (all optional; text of one or more lines, re-indented):
#   zone      the llama_session_zone line(s), default
#             "llama_session_zone zone=llama:1m;"; location / has the
#             llama_session of the first zone
#   upstream  proxy through "upstream llama { server 127.0.0.1:%%LLAMA%%;
#             ... }", with these directives after the server ('' for none,
#             'keepalive 4;', which gets 'keepalive_timeout 4s;' unless it
#             has one): BACKEND is then llama, without upstream =>
#             127.0.0.1:%%LLAMA%%
#   http      more of http {}: upstream, map, log_format, ...
#   listen    parameters of the listen line after the address (reuseport)
#   server    directives of the server before its locations (add_header,
#             llama_session_namespace, another listen, ...)
#   location  directives of location / after llama_session and proxy_pass
#   slots     directives of the slots location after internal and proxy_pass
#   extra     more locations of the server (/api/, /metrics, ...)
#
#   $t->nginx($t->site(
#       zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
#       location => 'add_header X-S-Action $llama_session_action always;',
#       extra => 'location /api/ { llama_session_api llama; }'));
#
# The placeholders are left for nginx() to expand; the text depends on
# nothing of $t, so LlamaTest->site(...) gives it before there is one.
my %SITE = map { $_ => 1 }
           qw(zone upstream http listen server location slots extra);

sub site {
    my ($self, %o) = @_;

    my @unknown = grep { !$SITE{$_} } sort keys %o;
    die "site: no piece named @unknown\n" if @unknown;

    my $zone = $o{zone} // 'llama_session_zone zone=llama:1m;';
    my ($name) = $zone =~ /\bzone=([^:\s;]+):/
        or die "site: no zone=name:size in '$zone'\n";
    my $backend = defined $o{upstream} ? 'llama' : '127.0.0.1:%%LLAMA%%';
    my $listen = join ' ', '127.0.0.1:%%PORT%%',
                 grep { defined && /\S/ } $o{listen};

    # a piece at an indentation of its own: its common indent removed,
    # the one of its place added, no blank line at its ends
    my $at = sub {
        my ($text, $n) = @_;
        return '' unless defined $text && $text =~ /\S/;
        $text =~ s/\A\s*\n//;
        $text =~ s/\s+\z//;
        my ($min) = sort { $a <=> $b }
                    map { /^(\s*)/; length $1 } grep { /\S/ } split /\n/, $text;
        my $pad = ' ' x $n;
        return join '', map { /\S/ ? $pad . substr($_, $min) . "\n" : "\n" }
                        split /\n/, $text;
    };
    my $para = sub { my $s = $at->(@_); length $s ? "\n$s" : '' };

    my $text = $at->($zone, 4);
    if (defined $o{upstream}) {
        (my $u = $o{upstream}) =~ s/^\s+|\s+$//g;
        # llama-server (cpp-httplib) closes a kept-alive connection after
        # 5 s idle; nginx keeps one 60 s by default, and a POST sent on it
        # as it closes is not retried (a 502): below the backend's, as in
        # every example
        $u .= ' keepalive_timeout 4s;'
            if $u =~ /\bkeepalive\s+\d/ && $u !~ /keepalive_timeout/;
        $text .= "\n    upstream llama { server 127.0.0.1:%%LLAMA%%;"
               . (length $u ? " $u" : '') . " }\n";
    }
    $text .= $para->($o{http}, 4);
    $text .= "\n    server {\n        listen $listen;\n";
    $text .= $para->($o{server}, 8);
    $text .= "\n        location / {\n"
           . "            llama_session $name;\n"
           . "            proxy_pass http://$backend;\n"
           . $at->($o{location}, 12)
           . "        }\n";
    $text .= "\n        location /_llama_slots/ {\n"
           . "            internal;\n"
           . "            proxy_pass http://$backend/;\n"
           . $at->($o{slots}, 12)
           . "        }\n";
    $text .= $para->($o{extra}, 8);
    $text .= "    }\n";

    return $text;
}

# starts nginx on DIR/nginx.conf as it is (after stop_nginx, say)
sub start_nginx {
    my ($self) = @_;
    my $dir = $self->{dir};

    my @cmd = ($ENV{NGINX_BINARY} // '/usr/sbin/nginx',
               '-p', "$dir/", '-c', "$dir/nginx.conf", '-e', "$dir/error.log");

    if ($ENV{TEST_NGINX_VALGRIND}) {
        unshift @cmd, 'valgrind', '-q', '--vgdb=no', '--leak-check=full',
            '--show-possibly-lost=no', '--trace-children=yes',
            "--suppressions=$ROOT/t/valgrind.supp",
            "--log-file=$dir/valgrind.%p.log", '--error-exitcode=7';
    }

    $self->spawn('nginx', "$dir/nginx.out", @cmd);
    $self->wait_port($self->{nginx_port},
                     $ENV{TEST_NGINX_VALGRIND} ? 60 : 10, 'nginx');

    return $self;
}

sub expand {
    my ($self, $text) = @_;
    my $dir = $self->{dir};
    $text =~ s/%%PORT%%/$self->{nginx_port}/g;
    $text =~ s/%%H2%%/$self->{h2_port} \/\/= port()/ge;
    $text =~ s/%%LLAMA:(\w+)%%/$self->{llama_port}{$1} \/\/ die "no backend $1"/ge;
    $text =~ s/%%LLAMA%%/(values %{ $self->{llama_port} })[0]/ge;
    $text =~ s/%%DIR%%/$dir/g;
    $text =~ s/%%SLOTS%%/$self->{slots} \/\/ "$dir\/slots"/ge;
    return $text;
}

# nginx -t on a configuration: returns (exit code, output)
sub nginx_test {
    my ($self, $http) = @_;
    $self->nginx($http, write_only => 1);
    my $dir = $self->{dir};
    my $out = `${\($ENV{NGINX_BINARY} // '/usr/sbin/nginx')} -t -p $dir/ -c $dir/nginx.conf -e $dir/nginx-t.log 2>&1`;
    # a crash is no success: 128 + the signal
    return ($? & 127 ? 128 + ($? & 127) : $? >> 8, $out);
}

sub reload {
    my ($self) = @_;
    my $log = $self->read_file('error.log');
    my $before = () = $log =~ /reconfiguring/g;
    kill 'HUP', $self->{pids}{nginx};
    my $end = time + 10;
    while (time < $end) {
        my $n = () = $self->read_file('error.log') =~ /reconfiguring/g;
        return 1 if $n > $before;
        sleep 0.05;
    }
    die "nginx did not reload\n";
}

sub stop_nginx {
    my ($self) = @_;
    my $pid = $self->{pids}{nginx} or return;
    kill 'QUIT', $pid;
    my $end = time + ($ENV{TEST_NGINX_VALGRIND} ? 60 : 15);
    while (time < $end) {
        if (waitpid($pid, WNOHANG) != 0) {
            delete $self->{pids}{nginx};
            return;
        }
        sleep 0.05;
    }
    $self->stop_proc('nginx', 'KILL');
}

sub url {
    my ($self, $path) = @_;
    return "http://127.0.0.1:$self->{nginx_port}$path";
}

# a request through nginx: returns HTTP::Tiny's response with ->{json}
sub request {
    my ($self, $method, $path, %o) = @_;

    my %h = %{ $o{headers} // {} };
    my $content = $o{body};
    if (ref $content) {
        $content = $JSON->encode($content);
        $h{'content-type'} //= 'application/json';
    }

    my $url = $o{port} ? "http://127.0.0.1:$o{port}$path" : $self->url($path);
    my $r = $self->{http}->request($method, $url,
                                   { headers => \%h,
                                     defined $content
                                       ? (content => $content) : () });
    $r->{json} = eval { $JSON->decode($r->{content}) }
        if ($r->{headers}{'content-type'} // '') =~ /json/;
    return $r;
}

sub post { my ($self, $path, $body, %o) = @_;
           $self->request('POST', $path, body => $body, %o) }
sub get  { my ($self, $path, %o) = @_; $self->request('GET', $path, %o) }

# a streamed (SSE) request: returns (status, [events], raw text)
sub stream {
    my ($self, $path, $body, %o) = @_;
    my $buf = '';
    my $r = $self->{http}->request('POST', $self->url($path), {
        headers => { 'content-type' => 'application/json',
                     %{ $o{headers} // {} } },
        content => $JSON->encode($body),
        data_callback => sub { $buf .= $_[0] },
    });
    my @events;
    for my $line (split /\n/, $buf) {
        next unless $line =~ /^data: (.*)/;
        next if $1 eq '[DONE]';
        push @events, eval { $JSON->decode($1) } // $1;
    }
    return ($r->{status}, \@events, $buf, $r);
}

# a raw request on a socket: returns the socket, for tests that leave
sub raw_open {
    my ($self, $method, $path, $body, %o) = @_;
    my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                                  PeerPort => $o{port} // $self->{nginx_port},
                                  Proto => 'tcp') or die "connect: $!";
    my $h = join '', map { "$_: $o{headers}{$_}\r\n" }
                     sort keys %{ $o{headers} // {} };
    $body = $JSON->encode($body) if ref $body;
    $body //= '';
    print $s "$method $path HTTP/1.1\r\nHost: localhost\r\n"
           . "Content-Type: application/json\r\n$h"
           . "Content-Length: " . length($body) . "\r\n"
           . "Connection: close\r\n\r\n$body";
    return $s;
}

# a request in a child process (a POST; get => 1: a GET; method => M:
# another): returns a handle for async_wait
sub async_post {
    my ($self, $path, $body, %o) = @_;

    my $file = "$self->{dir}/async." . ++$self->{async} . '.json';
    my $pid = fork();
    die "fork: $!" unless defined $pid;

    if ($pid == 0) {
        my $t0 = time;
        my $get = delete $o{get};
        my $method = delete $o{method};
        my $r = $get ? $self->get($path, %o)
              : $method ? $self->request($method, $path, %o)
              : $self->post($path, $body, %o);
        open my $fh, '>', "$file.tmp" or die;
        print $fh $JSON->encode({ status => $r->{status},
                                  headers => $r->{headers},
                                  json => $r->{json},
                                  content => $r->{content},
                                  start => $t0, end => time });
        close $fh;
        rename "$file.tmp", $file;
        $self->{stopped} = 1;    # the parent owns the processes
        POSIX::_exit(0);
    }

    return { pid => $pid, file => $file };
}

sub async_get { my ($self, $path, %o) = @_;
                $self->async_post($path, undef, %o, get => 1) }

# has the request of async_post() been answered yet?
sub async_done {
    my ($self, $h) = @_;
    return 1 if $h->{reaped};
    return 0 if waitpid($h->{pid}, WNOHANG) == 0;
    $h->{reaped} = 1;
    return 1;
}

sub async_wait {
    my ($self, $h, $timeout) = @_;
    my $end = time + ($timeout // 120);
    while (time < $end) {
        if ($h->{reaped} || waitpid($h->{pid}, WNOHANG) != 0) {
            my $s = $self->read_file($h->{file});
            return $s ? $JSON->decode($s) : { status => 0 };
        }
        sleep 0.02;
    }
    kill 'KILL', $h->{pid};
    waitpid($h->{pid}, 0);
    return { status => 0, timeout => 1 };
}

# nginx's workers now: their resident memory (kB) and CPU time (s), summed
sub workers {
    my ($self) = @_;
    return split ' ', `pgrep -P \$(cat $self->{dir}/nginx.pid)`;
}

sub workers_kb {
    my ($self) = @_;
    my $kb = 0;
    for my $pid ($self->workers) {
        my $s = `ps -o rss= -p $pid`;
        $s =~ s/\s//g;
        $kb += $s || 0;
    }
    return $kb;
}

sub workers_cpu {
    my ($self) = @_;
    my $ticks = 0;
    for my $pid ($self->workers) {
        my @f = split ' ', $self->read_file("/proc/$pid/stat");
        $ticks += ($f[13] // 0) + ($f[14] // 0);
    }
    return $ticks / 100;
}

sub read_file {
    my ($self, $name) = @_;
    my $f = $name =~ m{^/} ? $name : "$self->{dir}/$name";
    open my $fh, '<', $f or return '';
    local $/;
    my $s = <$fh>;
    close $fh;
    return $s;
}

# error.log lines that match
sub log_lines {
    my ($self, $re) = @_;
    return grep { /$re/ } split /\n/, $self->read_file('error.log');
}

sub wait_for {
    my ($self, $cond, $timeout) = @_;
    my $end = time + ($timeout // 10);
    while (time < $end) {
        return 1 if $cond->();
        sleep 0.05;
    }
    return 0;
}

sub stop {
    my ($self) = @_;
    return if $self->{stopped}++;

    $self->stop_nginx;
    $self->stop_proc($_, 'TERM') for keys %{ $self->{pids} };

    my $log = $self->read_file('error.log') . $self->read_file('nginx.out');
    my @bad = grep { /\[(alert|emerg)\]|Sanitizer|segfault|signal 11/ }
              split /\n/, $log;
    for my $re (@{ $self->{allow_alerts} // [] }) {
        @bad = grep { !/$re/ } @bad;
    }
    ok(!@bad, 'no alerts in error.log') or diag join "\n", @bad[0 .. ($#bad > 9 ? 9 : $#bad)];

    if ($ENV{TEST_NGINX_VALGRIND}) {
        my @reports;
        for my $f (glob "$self->{dir}/valgrind.*.log") {
            my $v = $self->read_file($f);
            push @reports, $v if $v =~ /\S/;
        }
        ok(!@reports, 'valgrind found nothing') or diag $reports[0];
    }

    if (!Test::More->builder->is_passing || $ENV{TEST_KEEP}) {
        diag "kept the test's files in $self->{dir}";
    } else {
        remove_tree($self->{dir});
    }
}

sub allow_alerts { my ($self, @re) = @_; push @{ $self->{allow_alerts} }, @re }

sub DESTROY { $_[0]->stop }

END {
    my $rc = $?;
    $_->stop for @ALL;
    $? = $rc;
}

$SIG{INT} = $SIG{TERM} = sub { $_->stop for @ALL; exit 1 };

1;
