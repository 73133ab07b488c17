#!/usr/bin/perl

# The module loads into the stock nginx, nginx -t accepts the example
# configuration, and wrong configurations fail nginx -t with an error that
# names the problem.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new;
my $module = LlamaTest::module_path();
my $nginx = $ENV{NGINX_BINARY} // '/usr/sbin/nginx';
my $dir = $t->dir;

ok(-f $module, 'the module is built');

# load_module and nothing else, as Debian's module packaging checks it
open my $fh, '>', "$dir/load.conf" or die;
print $fh "load_module $module;\nevents {}\n";
close $fh;
my $out = `$nginx -q -t -p $dir/ -c $dir/load.conf -e $dir/t.log -g 'pid $dir/t.pid;' 2>&1`;
is($?, 0, 'the module loads into nginx') or diag $out;

# a module built for another nginx (the rig's nginx.org stable, or any in
# the cache: make rig-stable): nginx -t names both versions
my ($ver) = `$nginx -v 2>&1` =~ m{nginx/(\d+\.\d+\.\d+)};
my $cache = $ENV{LLAMA_RIG_CACHE} // '/var/cache/llama-session-rig';
# (not the ASan build of make asan: it loads only with ASan's runtime first)
my ($other) = grep { m{/nginx-(\d+\.\d+\.\d+)/objs/} && $1 ne $ver
                     && !m{/nginx-asan/} }
              glob("$cache/nginx-*/nginx-*/objs/ngx_http_llama_session_module.so");
SKIP: {
    skip 'no module built for another nginx in the cache: make rig-stable', 1
        unless $other;
    my ($ov) = $other =~ m{/nginx-(\d+\.\d+\.\d+)/objs/};
    my $num = sub { my @v = split /\./, $_[0]; $v[0] * 1000000 + $v[1] * 1000 + $v[2] };
    open $fh, '>', "$dir/other.conf" or die;
    print $fh "load_module $other;\nevents {}\n";
    close $fh;
    $out = `$nginx -q -t -p $dir/ -c $dir/other.conf -e $dir/t.log -g 'pid $dir/t.pid;' 2>&1`;
    like($out, qr/module "\Q$other\E" version ${\ $num->($ov)} instead of ${\ $num->($ver)}/,
         "a module built for nginx $ov: nginx -t says which version it is for (docs/install.md)");
}

# the README's first screen: its configuration as a newcomer copies it
my $readme = $t->read_file("$LlamaTest::ROOT/README.md");
my ($first) = $readme =~ m{```nginx\n(.*?)```}s;
ok($first && $first =~ /llama_session_zone/ && $first =~ /llama_session llama;/,
   'the README starts with the configuration that matters');
$first =~ s{/var/lib/llama-session}{$dir/first-store}g;
LlamaTest::slots_dir("$dir/first-store");
$first =~ s{listen 443 ssl;}{listen 127.0.0.1:%%PORT%%;};
my ($frc, $fmsg) = $t->nginx_test($first);
is($frc, 0, 'nginx -t accepts the README\'s first configuration') or diag $fmsg;

# the example configuration, with the built module
my $example = $t->read_file("$LlamaTest::ROOT/examples/nginx.conf");
$example =~ s{/usr/lib/nginx/modules/ngx_http_llama_session_module\.so}{$module};
$example =~ s{/var/log/nginx/}{$dir/}g;
$example =~ s{/var/lib/llama-session}{$dir/slots}g;
LlamaTest::slots_dir("$dir/slots");
$example =~ s{^(events)}{pid $dir/t.pid;\nerror_log $dir/t.log;\n$1}m;
$example =~ s{^(http \{)}{$1\n    client_body_temp_path $dir/body;\n    proxy_temp_path $dir/proxy;}m;
open $fh, '>', "$dir/example.conf" or die;
print $fh $example;
close $fh;
$out = `$nginx -t -p $dir/ -c $dir/example.conf -e $dir/t.log 2>&1`;
is($?, 0, 'nginx -t accepts examples/nginx.conf') or diag $out;
like($out, qr/syntax is ok/, 'nginx -t says the syntax is ok');

# the tenants' example, in an http block of its own
my $tenants = $t->read_file("$LlamaTest::ROOT/examples/tenants.conf");
$tenants =~ s{/var/lib/llama-session}{$dir/slots}g;
$tenants =~ s{listen 8081;}{listen 127.0.0.1:%%PORT%%;};
my ($trc, $tmsg) = $t->nginx_test($tenants);
is($trc, 0, 'nginx -t accepts examples/tenants.conf') or diag $tmsg;

# one zone for all of a router's models
my $router = $t->read_file("$LlamaTest::ROOT/examples/router.conf");
$router =~ s{/var/lib/llama-session}{$dir/slots}g;
$router =~ s{listen 8081;}{listen 127.0.0.1:%%PORT%%;};
($trc, $tmsg) = $t->nginx_test($router);
is($trc, 0, 'nginx -t accepts examples/router.conf') or diag $tmsg;

# Open WebUI's site
my $owui = $t->read_file("$LlamaTest::ROOT/examples/openwebui.conf");
$owui =~ s{/var/lib/llama-session}{$dir/slots}g;
$owui =~ s{listen 8081;}{listen 127.0.0.1:%%PORT%%;};
($trc, $tmsg) = $t->nginx_test($owui);
is($trc, 0, 'nginx -t accepts examples/openwebui.conf') or diag $tmsg;

# Debian's site, in an http block of its own (t/84-deb.t runs it in
# Debian's stock /etc/nginx); the snakeoil certificate is the test's own
my $site = $t->read_file("$LlamaTest::ROOT/examples/sites-available/llama-session.conf");
unlike($site, qr/^\s*load_module/m, 'the site file has no load_module');
$site =~ s{/var/lib/llama-session}{$dir/slots}g;
$site =~ s{/var/log/nginx/}{$dir/}g;
$site =~ s{listen 443 ssl;}{listen 127.0.0.1:%%PORT%% ssl;};
$site =~ s{\s*listen \[::\]:443 ssl;}{};
$site =~ s{/etc/ssl/\S+/ssl-cert-snakeoil\.(pem|key)}{$dir/site.$1}g;
system("openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost "
       . "-keyout $dir/site.key -out $dir/site.pem -days 2 >/dev/null 2>&1");
($trc, $tmsg) = $t->nginx_test($site);
is($trc, 0, 'nginx -t accepts examples/sites-available/llama-session.conf')
    or diag $tmsg;

# what every example and doc says alike: one store path, and a slots
# location whose timeout fits a long save, restore or prime
for my $f (grep { -f } glob("$LlamaTest::ROOT/{README.md,docs/*.md,examples/*.conf,examples/*/*.conf,examples/systemd/*,examples/systemd/*/*}")) {
    my $text = $t->read_file($f);
    (my $name = $f) =~ s{^\Q$LlamaTest::ROOT\E/}{};
    unlike($text, qr{/var/cache/llama-slots}, "$name: one store path");
    while ($text =~ m{location\s+/_llama_slots/\s*\{(.*?)\}}sg) {
        like($1, qr/proxy_read_timeout\s+(1h|\d{4,}s)/,
             "$name: the slots location has a long proxy_read_timeout");
    }
}

# a minimal configuration: the zone, llama_session and the slots location
my $minimal = <<'EOF';
    llama_session_zone zone=llama:1m;
    server {
        listen 127.0.0.1:%%PORT%%;
        location / { llama_session llama; proxy_pass http://127.0.0.1:1; }
        location /_llama_slots/ { internal; proxy_pass http://127.0.0.1:1/; }
    }
EOF
my ($rc, $msg) = $t->nginx_test($minimal);
is($rc, 0, 'the minimal configuration is accepted') or diag $msg;

my @bad = (
    [ 'llama_session_zone llama:1m;',
      qr/invalid parameter "llama:1m"/, 'zone without zone=' ],
    [ 'llama_session_zone slots=1;',
      qr/must have "zone=name:size" parameter/, 'no zone= at all' ],
    [ 'llama_session_zone zone=llama;',
      qr/invalid zone size "zone=llama": use zone=name:size/, 'zone without size' ],
    [ 'llama_session_zone zone=llama:1k;',
      qr/zone "zone=llama:1k" is too small/, 'zone too small' ],
    [ 'llama_session_zone zone=llama:1m slots=0;',
      qr/invalid number of slots "slots=0"/, 'slots=0' ],
    [ 'llama_session_zone zone=llama:1m slots=x;',
      qr/invalid number of slots "slots=x"/, 'slots=x' ],
    [ 'llama_session_zone zone=llama:1m colour=blue;',
      qr/invalid parameter "colour=blue"/, 'unknown parameter' ],
    [ 'llama_session_zone zone=llama:1m reprime=maybe;',
      qr/invalid value "reprime=maybe": "reprime=" is "on" or "off"/,
      'reprime=maybe' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp max_files=x;',
      qr/invalid number of files "max_files=x"/, 'max_files=x' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp max_size=big;',
      qr/invalid size "max_size=big"/, 'max_size=big' ],
    [ 'llama_session_zone zone=llama:1m max_files=10;',
      qr/"max_files=", "max_size=" and "min_free=" need "store="/, 'max_files without store' ],
    [ 'llama_session_zone zone=llama:1m min_free=1g;',
      qr/"max_files=", "max_size=" and "min_free=" need "store="/, 'min_free without store' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp min_free=lots;',
      qr/invalid size "min_free=lots": min_free= is the free space to keep/, 'min_free=lots' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp store_timeout=soon;',
      qr/invalid time "store_timeout=soon": store_timeout= is how long a request waits for the store/,
      'store_timeout=soon' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp thread_pool=;',
      qr/empty "thread_pool=": the name of a thread_pool, "default", or "off"/,
      'thread_pool= empty' ],
    [ 'llama_session_zone zone=llama:1m store=/tmp thread_pool=nosuch;',
      qr/unknown thread pool "nosuch"/,
      'thread_pool= of no thread_pool' ],
    [ 'llama_session_zone zone=llama:1m save_idle=never;',
      qr/invalid time "save_idle=never"/, 'save_idle=never' ],
    [ 'llama_session_zone zone=llama:1m save_idle=30s;',
      qr/llama_session zone "llama" has "save_idle=" but no location has "llama_session llama" or "llama_session_api llama": its saves go through such a location's llama_session_slots_uri/,
      'save_idle without a location of the zone' ],
    [ "llama_session_zone zone=llama:1m;\nllama_session_zone zone=llama:1m;",
      qr/duplicate llama_session_zone "llama"/, 'duplicate zone' ],
    [ 'llama_session nope;',
      qr/unknown llama_session zone "nope"/, 'unknown zone' ],
    [ "llama_session_zone zone=llama:1m;\nllama_session llama;\nllama_session off;",
      qr/"llama_session" directive is duplicate/, 'duplicate llama_session' ],
    [ 'llama_session_slots_uri slots;',
      qr/invalid slots uri "slots": it must start with "\/"/, 'relative slots uri' ],
    [ 'llama_session_slots_uri /x?y;',
      qr/arguments and variables are not allowed/, 'slots uri with args' ],
    [ 'llama_session_id_headers "X Session";',
      qr/invalid header name "X Session"/, 'bad header name' ],
    [ 'llama_session_id_fields "a..b" ".x";',
      qr/invalid field name "a\.\.b"/, 'bad field name' ],
    [ 'llama_session_id_fallback maybe;',
      qr/invalid value "maybe"/, 'bad fallback' ],
    [ 'llama_session_wait_timeout soon;',
      qr/"llama_session_wait_timeout" directive invalid value/, 'bad timeout' ],
    [ 'llama_session_body_max lots;',
      qr/"llama_session_body_max" directive invalid value/, 'bad body_max' ],
    [ 'llama_session_endpoints chat/completions;',
      qr/invalid endpoint "chat\/completions": give the end of a path/,
      'endpoint without "/"' ],
    [ 'llama_session_endpoints /v1/chat/;',
      qr/invalid endpoint "\/v1\/chat\/"/, 'endpoint ending with "/"' ],
    [ 'llama_session_zone zone=llama:1m max_waiting=0;',
      qr/invalid number of waiting requests "max_waiting=0": 1 to 65536/,
      'max_waiting=0' ],
    [ 'llama_session_zone zone=llama:64k max_waiting=60000;',
      qr/zone "llama" is too small for max_waiting=60000/,
      'max_waiting too large for the zone' ],
    [ 'llama_session_zone zone=identity:1m;',
      qr/the zone name "identity" is reserved/, 'zone named identity' ],
    [ 'llama_session_warm always;',
      qr/invalid value "always" in "llama_session_warm": use "off", "system" or "history"/,
      'bad warm mode' ],
    [ 'llama_session_warm system size=1k;',
      qr/invalid parameter "size=1k" in "llama_session_warm": only "min=size" is known/,
      'bad warm parameter' ],
    [ 'llama_session_warm system min=lots;',
      qr/invalid size "lots" in "llama_session_warm" min=/, 'bad warm min' ],
    [ "llama_session_warm off;\nllama_session_warm system;",
      qr/"llama_session_warm" directive is duplicate/, 'duplicate warm' ],
    [ "llama_session_zone zone=a:1m store=%%DIR%%;\n"
      . "llama_session_zone zone=b:1m store=%%DIR%%;",
      qr/llama_session zones "a" and "b" have the same store/,
      'two zones, one store' ],
    [ "llama_session_zone zone=a:1m store=%%DIR%% shared=on;\n"
      . "llama_session_zone zone=b:1m store=%%DIR%%;",
      qr/llama_session zones "a" and "b" have the same store "[^"]+": one folder per llama-server, or "shared=on" on each/,
      'two zones, one store, shared=on on one only' ],
    [ 'llama_session_zone zone=a:1m shared=yes;',
      qr/invalid value "shared=yes": "shared=" is "on" or "off"/,
      'bad shared=' ],
    [ 'llama_session_zone zone=a:1m model=m;',
      qr/zone "a" with "model=" needs "store="/,
      'model= without store=' ],
    [ 'llama_session_zone zone=a.b:1m model=m store=%%DIR%%;',
      qr/zone "a\.b" with "model=" needs a name of 1 to 16 letters/,
      'model= zone with a dot in its name' ],
    [ 'llama_session_zone zone=a:1m model=m"x store=%%DIR%%;',
      qr/invalid model "m"x": 1 to 64 letters, digits or "\._:\/\+@-"/,
      'a model name with a quote' ],
    [ "server { listen 127.0.0.1:%%PORT%%; location / { llama_session_ollama on; } }",
      qr/"llama_session_ollama" needs "llama_session zone" in the same location/,
      'llama_session_ollama without a zone' ],
    [ 'llama_session_zone zone=a:1m model=m slots=auto store=%%DIR%%;',
      qr/zone "a" with "model=" cannot have "slots=auto"/,
      'model= with slots=auto' ],
    [ "llama_session_zone zone=a:1m model=m store=%%DIR%%;\n"
      . "llama_session_zone zone=b:1m model=m store=%%DIR%%;",
      qr/llama_session zones "a" and "b" drive the same model "m" of one router/,
      'two zones, one model' ],
    [ "llama_session_zone zone=a:1m model=m store=%%DIR%%;\n"
      . "llama_session_zone zone=b:1m store=%%DIR%%;",
      qr/llama_session zones "a" and "b" have the same store/,
      'a router\'s store and a zone without model=' ],
    [ "llama_session_zone zone=a:1m model=m store=%%DIR%%;\n"
      . "llama_session_zone zone=b:1m;\nllama_session a b;",
      qr/zone "b" has no "model=": several zones in "llama_session" are the models of llama-server's router/,
      'several zones, one without model=' ],
    [ "llama_session_zone zone=a:1m model=m store=%%DIR%%;\n"
      . "llama_session_zone zone=b:1m model=m store=%%DIR%%/x;\n"
      . "llama_session a b;",
      qr/zones "a" and "b" both drive the model "m"/,
      'two zones of one model in one location' ],
);

for my $case (@bad) {
    my ($conf, $re, $name) = @$case;
    my ($rc, $msg) = $t->nginx_test("$conf\n");
    isnt($rc, 0, "nginx -t refuses: $name");
    like($msg, $re, "the error names it: $name");
}

($rc, $msg) = $t->nginx_test(<<'EOF');
    llama_session_zone zone=llama:1m;
    server {
        listen 127.0.0.1:%%PORT%%;
        llama_session_id_headers off;
        llama_session_id_fields off;
        llama_session_id_fallback off;
        llama_session_namespace $remote_user;
        llama_session_wait_timeout 5s;
        llama_session_body_max 1m;
        llama_session_endpoints /v1/chat/completions /chat;
        location / { llama_session llama; proxy_pass http://127.0.0.1:1; }
    }
EOF
is($rc, 0, 'every identity directive can be set') or diag $msg;

# backend= and api_key= of earlier releases: accepted, said to be ignored
($rc, $msg) = $t->nginx_test(<<'EOF');
    llama_session_zone zone=llama:1m save_idle=30s backend=127.0.0.1:1
                       api_key=secret;
    server {
        listen 127.0.0.1:%%PORT%%;
        location / { llama_session llama; proxy_pass http://127.0.0.1:1; }
    }
EOF
is($rc, 0, 'nginx -t accepts the deprecated backend= and api_key=')
    or diag $msg;
like($msg, qr/"backend=" is deprecated and ignored: idle saves go through llama_session_slots_uri's location/,
     'nginx -t says backend= is ignored');
like($msg, qr/"api_key=" is deprecated and ignored: .*proxy_set_header Authorization/,
     'nginx -t says where the API key goes');

$t->stop;
done_testing;
